// The Deployments view: /v1/deployments and /v1/replicas, polled. Scale and undeploy call
// the same API as `nvpair scale` / `nvpair undeploy`; the API's refusal is shown as it says.
// An elastic deployment's card shows its bounds and what it did lately
// (/v1/deployments/events: scale-ups, scale-downs, cold starts with their seconds).
// Below them, the cluster's artifacts (/v1/artifacts): here and on each member, a fetch's
// progress as it goes.

import { getJSON, postJSON } from './api.js';
import { h, fill, fmtBytes, fmtTime, shortId } from './dom.js';
import { shared, showError, Poller } from './shared.js';

const POLL_MS = 3000;
const EVENTS_SHOWN = 5; // per deployment, the newest
const cards = new Map(); // name -> {sig, el, info, input, message}

const poller = new Poller(POLL_MS, refresh);

async function refresh() {
  const error = document.getElementById('deployments-error');
  let declared;
  let replicas;
  let events;
  try {
    [declared, replicas, events] = await Promise.all([
      getJSON('/v1/deployments'), getJSON('/v1/replicas'), getJSON('/v1/deployments/events')]);
    showError(error, '');
  } catch (exc) {
    showError(error, `Deployments: ${exc.message}`);
    return;
  }
  const box = document.getElementById('deployments');
  const seen = new Set();
  let previous = null;
  for (const d of declared) {
    seen.add(d.name);
    const mine = replicas.filter((r) => r.deployment === d.name && (!r.deploymentId || r.deploymentId === d.id));
    let card = cards.get(d.name);
    if (!card) {
      card = newCard(d.name);
      cards.set(d.name, card);
    }
    const told = events.filter((e) => e.deployment === d.name).slice(0, EVENTS_SHOWN);
    update(card, d, mine, told);
    const want = previous ? previous.nextSibling : box.firstChild;
    if (card.el !== want) box.insertBefore(card.el, want);
    previous = card.el;
  }
  for (const [name, card] of cards) {
    if (!seen.has(name)) {
      card.el.remove();
      cards.delete(name);
    }
  }
  document.getElementById('deployments-empty').hidden = declared.length > 0;
  await refreshArtifacts();
}

async function refreshArtifacts() {
  const error = document.getElementById('artifacts-error');
  let artifacts;
  try {
    artifacts = await getJSON('/v1/artifacts');
    showError(error, '');
  } catch (exc) {
    showError(error, `Artifacts: ${exc.message}`);
    return;
  }
  fill(document.querySelector('#artifacts tbody'), ...artifacts.map(artifactRow));
  document.getElementById('artifacts-empty').hidden = artifacts.length > 0;
}

function artifactRow(a) {
  const members = Object.entries(a.members || {}).sort(([x], [y]) => x.localeCompare(y));
  return h('tr', { class: 'artifact', 'data-name': a.name, 'data-here': a.here },
    h('td', {}, a.name),
    h('td', { title: a.digest }, a.digest.slice(0, 19)),
    h('td', {}, fmtBytes(a.size)),
    h('td', {}, a.warm ? 'warm' : ''),
    h('td', { class: 'here' }, h('span', { class: 'badge', 'data-state': a.here }, hereText(a))),
    h('td', { class: 'members' }, members.map(([name, state]) => `${name}: ${state}`).join(' · ')));
}

function hereText(a) {
  if (a.here === 'fetching') {
    const share = a.pieceCount ? Math.floor((100 * (a.held || 0)) / a.pieceCount) : 0;
    return `fetching ${share}% (${a.held || 0}/${a.pieceCount} pieces)`;
  }
  if (a.here === 'failed') return `failed: ${a.why || ''}`;
  return a.here;
}

function newCard(name) {
  const info = h('div', { class: 'info' });
  const input = h('input', { class: 'replicas', type: 'number', min: 0, max: 1000, step: 1,
    'aria-label': `replicas of ${name}` });
  const scale = h('button', { type: 'button', class: 'scale' }, 'Scale');
  const undeploy = h('button', { type: 'button', class: 'undeploy danger' }, 'Undeploy…');
  const confirm = h('button', { type: 'button', class: 'undeploy-confirm danger' }, `Undeploy ${name}`);
  const cancel = h('button', { type: 'button', class: 'undeploy-cancel' }, 'Keep it');
  const confirmBox = h('span', { class: 'confirm', hidden: true }, confirm, cancel);
  const message = h('p', { class: 'error', hidden: true });
  const el = h('article', { class: 'deployment card', 'data-name': name },
    info,
    h('div', { class: 'controls' },
      h('label', {}, 'Replicas ', input), scale, undeploy, confirmBox),
    message);
  const card = { el, info, input, message, sig: '', dirty: false };
  input.addEventListener('input', () => { card.dirty = true; });
  const act = async (path, body) => {
    for (const b of [scale, undeploy, confirm]) b.disabled = true;
    try {
      await postJSON(path, body);
      showError(message, '');
      card.dirty = false;
      poller.now();
    } catch (exc) {
      showError(message, exc.message);
    } finally {
      for (const b of [scale, undeploy, confirm]) b.disabled = false;
    }
  };
  const path = `/v1/deployments/${encodeURIComponent(name)}`;
  scale.addEventListener('click', () => {
    const wanted = Number(input.value);
    if (!Number.isInteger(wanted) || wanted < 0) {
      showError(message, 'replicas is a whole number, 0 or more');
      return;
    }
    act(`${path}/scale`, { replicas: wanted });
  });
  undeploy.addEventListener('click', () => {
    confirmBox.hidden = false;
    undeploy.hidden = true;
  });
  cancel.addEventListener('click', () => {
    confirmBox.hidden = true;
    undeploy.hidden = false;
  });
  confirm.addEventListener('click', async () => {
    await act(`${path}/undeploy`, {});
    confirmBox.hidden = true;
    undeploy.hidden = false;
  });
  return card;
}

function update(card, d, replicas, events) {
  const states = d.replicaStates || {};
  const ready = states.ready || 0;
  card.el.dataset.desired = String(d.replicas);
  card.el.dataset.ready = String(ready);
  card.el.dataset.authority = d.authority || '';
  if (!card.dirty && document.activeElement !== card.input) card.input.value = String(d.replicas);
  const { updatedAt, ...shown } = d;
  const sig = JSON.stringify([shown, replicas.map(({ loadAt, running, waiting, kvUsage, ...r }) => r), events]);
  if (sig === card.sig) return;
  card.sig = sig;
  const stateText = Object.entries(states).map(([s, n]) => `${n} ${s}`).join(', ') || 'no replicas yet';
  const c = d.constraints || {};
  const wants = [
    c.deviceClass && `class ${c.deviceClass}`,
    c.node && `node ${shared.nodeName(c.node)}`,
    c.oneDomain && 'one domain',
    c.minMemory && `min memory ${c.minMemory}`,
  ].filter(Boolean).join(', ');
  card.info.replaceChildren(
    h('header', {},
      h('h3', {}, d.name),
      h('span', { class: 'counts-line' }, h('span', { class: 'ready' }, String(ready)), ' ready of ',
        h('span', { class: 'desired' }, String(d.replicas)), ' desired'),
      h('span', { class: 'meta' }, [d.engine, d.source, `${d.gpus} GPU(s), TP ${d.tp}`, `v${d.version}`].filter(Boolean).join(' · '),
        d.authority && d.authority !== 'managed' ? ` · ${d.authority}` : '', wants ? ` · ${wants}` : '')),
    h('p', { class: 'states' }, stateText, ` · updated ${fmtTime(d.updatedAt)}`),
    d.elastic ? elasticPart(d.elastic, events) : null,
    replicas.length ? replicaTable(replicas) : null,
    ...replicas.filter((r) => r.state === 'failed').map(failedLog));
}

function elasticPart(bounds, events) {
  return h('div', { class: 'elastic' },
    h('p', { class: 'bounds' }, `scales on load: ${bounds.min} to ${bounds.max} replica(s) · last change: ${bounds.reason}`),
    events.length
      ? h('ul', { class: 'scale-events' }, events.map((e) => h('li', { class: 'scale-event', 'data-kind': e.kind }, eventText(e))))
      : null);
}

function eventText(e) {
  if (e.kind === 'cold-start') return `${fmtTime(e.at)} cold start: a replica ready in ${Number(e.seconds).toFixed(1)} s`;
  const by = shared.nodeName(e.by);
  return `${fmtTime(e.at)} ${e.kind === 'scale-up' ? 'scaled up' : 'scaled down'} ${e.previous} → ${e.replicas} (${e.reason}) by ${by}`;
}

function replicaTable(replicas) {
  return h('div', { class: 'scroll' }, h('table', { class: 'replica-table' },
    h('thead', {}, h('tr', {}, ['Replica', 'Node', 'Part', 'State', 'Restarts', 'GPUs', 'Port', 'Engine', 'Error'].map((t) => h('th', {}, t)))),
    h('tbody', {}, replicas.map((r) => h('tr', { class: 'replica-row', 'data-replica-id': r.id, 'data-state': r.state },
      h('td', { title: r.id }, shortId(r.id)),
      h('td', { 'data-node-id': r.nodeId }, r.node || shared.nodeName(r.nodeId)),
      h('td', { class: 'part', title: r.group || '' }, partOf(r)),
      h('td', { class: 'state' }, h('span', { class: 'badge' }, r.state)),
      h('td', {}, String(r.restarts ?? 0)),
      h('td', {}, String((r.devices || []).length)),
      h('td', {}, String(r.port ?? '')),
      h('td', {}, r.engineVersion || ''),
      h('td', { class: 'error' }, r.error || ''))))));
}

// A part of a replica across members (issue 32): "head 1/2", "worker 2/2"; "" for one of its own.
function partOf(r) {
  if (!r.layout || !r.layout.length) return '';
  const rank = Math.max(0, r.layout.findIndex(([node]) => node === r.nodeId));
  return `${rank === 0 ? 'head' : 'worker'} ${rank + 1}/${r.layout.length}`;
}

function failedLog(r) {
  const lines = r.logTail;
  return h('div', { class: 'failed-replica', 'data-replica-id': r.id },
    h('h4', {}, `Last log lines of ${shortId(r.id)} on ${r.node || shared.nodeName(r.nodeId)}`),
    lines && lines.length
      ? h('pre', { class: 'log' }, lines.join('\n'))
      : h('p', { class: 'log empty' }, `Its log stays on ${r.node || 'its node'}: open that member's page, or run nvpair logs ${r.id} there.`));
}

export function start() {}

export function show(on) {
  if (on) poller.start();
  else poller.stop();
}
