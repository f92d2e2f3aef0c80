// The Usage view: /v1/usage/series (this agent's own usage rows: counts, never text), drawn
// as small SVG charts and two tables.

import { getJSON } from './api.js';
import { h } from './dom.js';
import { showError, Poller } from './shared.js';
import { lines, bars, PALETTE } from './chart.js';

let windowS = 3600;
const poller = new Poller(10000, refresh);

const sum = (values) => (values || []).reduce((a, b) => a + (Number.isFinite(b) ? b : 0), 0);
const add = (a, b) => (a || []).map((v, i) => (v || 0) + ((b || [])[i] || 0));

function legend(name, names) {
  const box = document.querySelector(`[data-legend="${name}"]`);
  box.replaceChildren(...names.map((n, k) => h('span', { class: `key s${k % PALETTE}` }, n)));
}

function percentiles(svg, name, given) {
  const keys = ['p50', 'p95', 'p99'];
  const values = given || {};
  if (keys.some((k) => Array.isArray(values[k]))) {
    lines(svg, keys.map((k) => ({ name: k, values: values[k] || [] })), { windowS, bucketS: 0, unit: ' ms' });
    legend(name, keys);
  } else {
    bars(svg, keys.map((k) => ({ name: k, value: typeof values[k] === 'number' ? values[k] : NaN })), { unit: ' ms' });
    legend(name, []);
  }
}

function table(id, groups) {
  const body = document.querySelector(`#${id} tbody`);
  const rows = Object.entries(groups || {})
    .map(([name, g]) => ({ name, requests: sum(g.requests), promptTokens: sum(g.promptTokens), completionTokens: sum(g.completionTokens) }))
    .sort((a, b) => b.requests - a.requests || (a.name < b.name ? -1 : 1));
  body.replaceChildren(...rows.map((r) => h('tr', { 'data-name': r.name },
    h('td', { class: 'name' }, r.name),
    h('td', { class: 'requests', 'data-value': r.requests }, String(r.requests)),
    h('td', { class: 'prompt-tokens', 'data-value': r.promptTokens }, String(r.promptTokens)),
    h('td', { class: 'completion-tokens', 'data-value': r.completionTokens }, String(r.completionTokens)))));
  if (!rows.length) body.append(h('tr', {}, h('td', { colspan: 4, class: 'empty' }, 'nothing in this window')));
}

async function refresh() {
  const error = document.getElementById('usage-error');
  let series;
  try {
    series = await getJSON('/v1/usage/series', { window: windowS });
    showError(error, '');
  } catch (exc) {
    showError(error, `Usage: ${exc.message}`);
    return;
  }
  const models = Object.entries(series.models || {}).sort(([a], [b]) => (a < b ? -1 : 1));
  const opts = { windowS: series.windowS || windowS, bucketS: series.bucketS };
  lines(document.querySelector('svg.chart[data-series="requests"]'),
    models.map(([name, g]) => ({ name, values: g.requests || [] })), opts);
  legend('requests', models.map(([name]) => name));
  lines(document.querySelector('svg.chart[data-series="tokens"]'),
    models.map(([name, g]) => ({ name, values: add(g.promptTokens, g.completionTokens) })), opts);
  legend('tokens', models.map(([name]) => name));
  percentiles(document.querySelector('svg.chart[data-series="ttft"]'), 'ttft', series.ttftMs);
  percentiles(document.querySelector('svg.chart[data-series="latency"]'), 'latency', series.latencyMs);
  table('usage-models', series.models);
  table('usage-keys', series.keys);
}

export function start() {
  for (const button of document.querySelectorAll('button.window')) {
    button.addEventListener('click', () => {
      windowS = Number(button.dataset.window);
      for (const b of document.querySelectorAll('button.window')) b.setAttribute('aria-pressed', String(b === button));
      poller.now();
    });
  }
}

export function show(on) {
  if (on) poller.start();
  else poller.stop();
}
