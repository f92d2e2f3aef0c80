// The Jobs view: a page of the list, kept live by the agent's event stream
// (`/v1/jobs/stream`), filtered the same way on the server (the query) and here (each
// event). The DOM holds at most LIVE_KEEP rows plus what "More" loaded, whatever the store
// holds: 100,000 jobs cost one page.

import { getJSON } from './api.js';
import { JobTokens } from './job_tokens.js';
import { follow } from './job_stream.js';
import { h, fmtMs, fmtCount } from './dom.js';
import { shared, showError } from './shared.js';

const PAGE = 100;
const LIVE_KEEP = 500;
const MAX_PAGE = 10000; // the store's largest page
const STATES = ['queued', 'running', 'completed', 'failed', 'cancelled'];
const ACTIVE = new Set(['queued', 'running']);

const rows = new Map(); // "origin/runId/id" -> {job, tr}
// Tokens come from this member's usage rows; a row's cell is redrawn when they arrive.
const usage = new JobTokens(rows, jobKey, (row) => row.tr.querySelector('td.tokens').replaceWith(tokenCell(row.job)));
const models = new Set(); // seen, for the model filter's suggestions (bounded)
let next = null; // the cursor "More" follows; STALE once rows were dropped at the bottom
const STALE = Symbol('stale');
let paged = 0; // rows "More" loaded: kept on top of LIVE_KEEP
let filters = { state: '', model: '', node: '', requester: '' };
let generation = 0;
let buffered = null; // events that arrive while a page is loading
let visible = false;
let els = null;

/** A job's identity across members (the DOM's data-job-id). */
export function jobKey(job) {
  return `${job.originatedFrom}/${job.runId}/${job.id}`;
}

function query() {
  return {
    model: filters.model,
    node: filters.node ? shared.nodeIdFor(filters.node) : '',
    requester: filters.requester,
  };
}

/** Whether a job passes the filters, as the store's query decides it. */
export function matches(job, f = filters) {
  if (f.state && job.state !== f.state) return false;
  if (f.model && job.model !== f.model) return false;
  if (f.requester && job.requesterId !== f.requester) return false;
  if (f.node) {
    const node = shared.nodeIdFor(f.node);
    const on = job.scheduledOn ?? job.originatedFrom;
    if (on !== node) return false;
  }
  return true;
}

/** The store's order: newest first (createdAt, id, origin, runId, all descending). */
export function newer(a, b) {
  for (const k of ['createdAt', 'id', 'originatedFrom', 'runId']) {
    if (a[k] === b[k]) continue;
    return a[k] > b[k];
  }
  return false;
}

function durations(job, now) {
  const { createdAt, startedAt, completedAt } = job;
  let queued = null;
  let run = null;
  if (typeof startedAt === 'number') queued = startedAt - createdAt;
  else if (ACTIVE.has(job.state)) queued = now - createdAt;
  else if (typeof completedAt === 'number') queued = completedAt - createdAt;
  if (typeof startedAt === 'number') {
    if (typeof completedAt === 'number') run = completedAt - startedAt;
    else if (job.state === 'running') run = now - startedAt;
  }
  return { queued, run };
}

function tokensOf(job) {
  if (typeof job.promptTokens === 'number') {
    return { promptTokens: job.promptTokens, completionTokens: job.completionTokens ?? 0 };
  }
  return usage.get(jobKey(job));
}

function tokenCell(job) {
  const t = tokensOf(job);
  if (t) {
    return h('td', { class: 'tokens', 'data-prompt': t.promptTokens, 'data-completion': t.completionTokens,
      title: 'prompt + completion tokens' }, `${fmtCount(t.promptTokens)} + ${fmtCount(t.completionTokens)}`);
  }
  const elsewhere = job.originatedFrom !== shared.selfId;
  return h('td', { class: 'tokens', title: elsewhere ? 'kept on the node it came in through' : '' }, '–');
}

function cells(job) {
  const now = Date.now();
  const { queued, run } = durations(job, now);
  const origin = shared.nodeName(job.originatedFrom);
  return [
    h('td', { class: 'state' }, h('span', { class: 'badge' }, job.state)),
    h('td', { class: 'job', title: jobKey(job) }, `${origin}#${job.id}`),
    h('td', { class: 'model' }, job.model ?? ''),
    h('td', { class: 'engine' }, job.engine ?? ''),
    h('td', { class: 'origin', 'data-node-id': job.originatedFrom }, origin),
    h('td', { class: 'scheduled', 'data-node-id': job.scheduledOn ?? '' },
      job.scheduledOn ? shared.nodeName(job.scheduledOn) : '–'),
    h('td', { class: 'requester' }, job.requesterId ?? '–'),
    h('td', { class: 'created' }, new Date(job.createdAt).toLocaleTimeString()),
    h('td', { class: 'queued-ms', 'data-ms': queued ?? '' }, fmtMs(queued)),
    h('td', { class: 'run-ms', 'data-ms': run ?? '' }, fmtMs(run)),
    tokenCell(job),
    h('td', { class: 'error' }, job.error ?? ''),
  ];
}

function render(tr, job) {
  tr.dataset.state = job.state;
  tr.replaceChildren(...cells(job));
}

function newRow(job) {
  const tr = h('tr', { 'data-job-id': jobKey(job) });
  render(tr, job);
  if (models.size < 200 && job.model) models.add(job.model);
  return tr;
}

function drop(key) {
  const row = rows.get(key);
  if (!row) return;
  row.tr.remove();
  rows.delete(key);
  usage.forget(key);
}

/** One job's change: update its row, add it in order, or take it out of a filtered list. */
function apply(job) {
  if (buffered) {
    buffered.push(job);
    return;
  }
  const key = jobKey(job);
  const have = rows.get(key);
  if (have && typeof have.job.seq === 'number' && typeof job.seq === 'number' && job.seq < have.job.seq) {
    return; // an older version than shown (a reload's page and the stream crossed)
  }
  if (!matches(job)) {
    drop(key);
    emptyLine();
    return;
  }
  if (have) {
    have.job = job;
    render(have.tr, job);
  } else {
    const body = els.table.tBodies[0];
    let before = null;
    for (const tr of body.rows) {
      if (newer(job, rows.get(tr.dataset.jobId).job)) {
        before = tr;
        break;
      }
    }
    if (before === null && next !== null) return; // it belongs to a page not loaded yet
    const tr = newRow(job);
    body.insertBefore(tr, before);
    rows.set(key, { job, tr });
    trim();
  }
  usage.want(job);
  emptyLine();
}

function trim() {
  const body = els.table.tBodies[0];
  while (rows.size > LIVE_KEEP + paged) {
    drop(body.rows[body.rows.length - 1].dataset.jobId);
    next = STALE;
  }
  moreButton();
}

function moreButton() {
  els.more.hidden = next === null;
}

function emptyLine() {
  els.empty.hidden = rows.size > 0;
}

/** The first page again (filters changed, the stream said `reset`, or it reconnected). */
export async function reload() {
  const gen = ++generation;
  buffered = [];
  scheduleCounts(0);
  try {
    const page = await getJSON('/v1/jobs', { ...query(), state: filters.state, page: 1, limit: PAGE });
    if (gen !== generation) return;
    rows.clear();
    const body = els.table.tBodies[0];
    body.replaceChildren();
    for (const job of page.jobs) {
      const tr = newRow(job);
      body.append(tr);
      rows.set(jobKey(job), { job, tr });
      usage.want(job);
    }
    next = page.next;
    paged = 0;
    showError(els.error, '');
  } catch (exc) {
    if (gen !== generation) return;
    showError(els.error, `The Jobs list: ${exc.message}`);
  }
  const waiting = buffered || [];
  buffered = null;
  for (const job of waiting) apply(job);
  moreButton();
  emptyLine();
  suggestModels();
}

async function more() {
  if (next === null) return;
  const gen = generation;
  els.more.disabled = true;
  try {
    let page;
    if (next === STALE) {
      // Rows were dropped at the bottom: no cursor names the last one kept; read from the top.
      const limit = Math.min(MAX_PAGE, rows.size + PAGE);
      page = await getJSON('/v1/jobs', { ...query(), state: filters.state, page: 1, limit });
    } else {
      page = await getJSON('/v1/jobs', { ...query(), state: filters.state, after: next, limit: PAGE });
    }
    if (gen !== generation) return;
    const body = els.table.tBodies[0];
    let added = 0;
    for (const job of page.jobs) {
      const key = jobKey(job);
      const have = rows.get(key);
      if (have) {
        if (!(typeof job.seq === 'number' && job.seq < have.job.seq)) {
          have.job = job;
          render(have.tr, job);
        }
        continue;
      }
      const tr = newRow(job);
      body.append(tr);
      rows.set(key, { job, tr });
      usage.want(job);
      added += 1;
    }
    paged += added;
    next = page.next;
    showError(els.error, '');
  } catch (exc) {
    showError(els.error, `More jobs: ${exc.message}`);
  } finally {
    els.more.disabled = false;
  }
  moreButton();
  emptyLine();
}

// Counts per state, with the filters but the state's (so they also pick the state).
let countsTimer = null;
let countsWork = true;
function scheduleCounts(ms = 1000) {
  if (!countsWork || countsTimer !== null) return;
  countsTimer = setTimeout(async () => {
    countsTimer = null;
    try {
      const counts = await getJSON('/v1/jobs/counts', query());
      for (const state of STATES) {
        const n = counts.byState?.[state] ?? 0;
        els.counts.querySelector(`[data-state="${state}"] .n`).textContent = String(n);
      }
      document.getElementById('job-total').textContent = String(counts.total ?? '');
    } catch (exc) {
      if (exc.status === 404 || exc.status === 405) countsWork = false;
    }
  }, ms);
}

function suggestModels() {
  const list = document.getElementById('known-models');
  list.replaceChildren(...[...models].sort().map((m) => h('option', { value: m })));
}

function tick() {
  // Queued and running jobs' times grow while they are shown.
  if (!visible) return;
  const now = Date.now();
  for (const { job, tr } of rows.values()) {
    if (!ACTIVE.has(job.state)) continue;
    const { queued, run } = durations(job, now);
    const q = tr.querySelector('td.queued-ms');
    const r = tr.querySelector('td.run-ms');
    q.textContent = fmtMs(queued);
    q.dataset.ms = queued ?? '';
    r.textContent = fmtMs(run);
    r.dataset.ms = run ?? '';
  }
}

let debounce = null;
function readFilters() {
  filters = {
    state: document.getElementById('filter-state').value,
    model: document.getElementById('filter-model').value.trim(),
    node: document.getElementById('filter-node').value.trim(),
    requester: document.getElementById('filter-requester').value.trim(),
  };
  for (const button of els.counts.querySelectorAll('button[data-state]')) {
    button.setAttribute('aria-pressed', String(button.dataset.state === filters.state));
  }
  reload();
}

let startedOnce = false;
export function start() {
  if (startedOnce) return;
  startedOnce = true;
  els = {
    table: document.getElementById('jobs'),
    more: document.getElementById('more'),
    empty: document.getElementById('jobs-empty'),
    error: document.getElementById('jobs-error'),
    counts: document.getElementById('job-counts'),
  };
  const form = document.getElementById('job-filters');
  form.addEventListener('submit', (e) => e.preventDefault());
  document.getElementById('filter-state').addEventListener('change', readFilters);
  for (const id of ['filter-model', 'filter-node', 'filter-requester']) {
    const input = document.getElementById(id);
    input.addEventListener('change', readFilters);
    input.addEventListener('input', () => {
      clearTimeout(debounce);
      debounce = setTimeout(readFilters, 400);
    });
  }
  for (const button of els.counts.querySelectorAll('button[data-state]')) {
    button.addEventListener('click', () => {
      const select = document.getElementById('filter-state');
      select.value = select.value === button.dataset.state ? '' : button.dataset.state;
      readFilters();
    });
  }
  els.more.addEventListener('click', more);
  setInterval(tick, 1000);
  reload();
}

export function show(on) {
  visible = on;
}

/** The stream: always on, so #conn tells its state on every view. */
export function connect() {
  follow({
    job(job) {
      apply(job);
      scheduleCounts();
    },
    reset: reload, // the point asked for is no longer held, or a new stream began
  });
}
