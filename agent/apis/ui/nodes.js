// The Nodes view: every member's record from /v1/nodes (polled: it is cheap), each node
// redrawn only when its record changed. One bar per GPU, GPUs grouped by topology domain.

import { getJSON } from './api.js';
import { h, fmtBytes, shortId } from './dom.js';
import { shared, showError, Poller } from './shared.js';

const POLL_MS = 3000;
const MAX_COUNTED = 32; // members whose pending work is asked each poll
const drawn = new Map(); // nodeId -> {sig, el}
let countsWork = true;
let pending = new Map(); // nodeId -> {queued, running}
let ops = [];

const poller = new Poller(POLL_MS, async () => {
  const error = document.getElementById('nodes-error');
  let records;
  try {
    records = await getJSON('/v1/nodes');
    showError(error, '');
  } catch (exc) {
    showError(error, `Members' records: ${exc.message}`);
    return;
  }
  shared.setNodes(records);
  try {
    ops = await getJSON('/v1/ops');
  } catch (_) {
    ops = [];
  }
  if (countsWork) await countPending(records.slice(0, MAX_COUNTED));
  draw(records);
});

async function countPending(records) {
  const answers = await Promise.allSettled(
    records.map((r) => getJSON('/v1/jobs/counts', { node: r.nodeId })),
  );
  pending = new Map();
  answers.forEach((answer, i) => {
    if (answer.status === 'fulfilled') {
      const by = answer.value.byState || {};
      pending.set(records[i].nodeId, { queued: by.queued || 0, running: by.running || 0 });
    } else if (answer.reason?.status === 404 || answer.reason?.status === 405) {
      countsWork = false;
    }
  });
}

function draw(records) {
  const box = document.getElementById('nodes');
  const seen = new Set();
  let previous = null;
  for (const record of records) {
    const id = record.nodeId;
    seen.add(id);
    const theirOps = ops.filter((op) => op.target === id && ['pending', 'running'].includes(op.phase));
    const { signature, updatedAt, generation, ...shown } = record;
    const sig = JSON.stringify([shown, theirOps, pending.get(id) || null]);
    let entry = drawn.get(id);
    if (!entry || entry.sig !== sig) {
      const el = nodeCard(record, theirOps, pending.get(id));
      if (entry) entry.el.replaceWith(el);
      entry = { sig, el };
      drawn.set(id, entry);
    }
    const want = previous ? previous.nextSibling : box.firstChild;
    if (entry.el !== want) box.insertBefore(entry.el, want);
    previous = entry.el;
  }
  for (const [id, entry] of drawn) {
    if (!seen.has(id)) {
      entry.el.remove();
      drawn.delete(id);
    }
  }
}

function pct(x) {
  return `${Math.max(0, Math.min(100, x)).toFixed(0)}%`;
}

function bar(fraction, label, kind) {
  const fillEl = h('span', { class: 'fill' });
  fillEl.style.width = pct(fraction * 100); // CSSOM, not a style attribute: CSP allows it
  const level = fraction >= 0.9 ? 'high' : fraction >= 0.7 ? 'mid' : 'low';
  return h('span', { class: `bar ${kind || ''}`, 'data-level': level, role: 'meter',
    'aria-valuemin': 0, 'aria-valuemax': 100, 'aria-valuenow': Math.round(fraction * 100), 'aria-label': label },
  fillEl, h('span', { class: 'bar-label' }, label));
}

function gpu(device) {
  const total = device.memoryTotal || 0;
  const used = device.memoryUsed || 0;
  const health = device.health || 'unknown';
  return h('div', {
    class: 'gpu',
    'data-device-id': device.id,
    'data-memory-used': used,
    'data-memory-total': total,
    'data-utilization': device.utilization ?? '',
    'data-temperature': device.temperatureC ?? '',
    'data-health': health,
  },
  h('div', { class: 'gpu-head' },
    h('span', { class: 'gpu-name', title: device.uuid || '' }, `GPU ${device.index ?? ''} · ${device.deviceClass || device.name || ''}`),
    h('span', { class: 'health badge', 'data-health': health }, health)),
  bar(total ? used / total : 0, `memory ${fmtBytes(used)} / ${fmtBytes(total)}`, 'memory'),
  bar(typeof device.utilization === 'number' ? device.utilization / 100 : 0, `util ${device.utilization ?? '–'}%`, 'util'),
  h('div', { class: 'gpu-stats' },
    h('span', { class: 'temp' }, `${device.temperatureC ?? '–'} °C`),
    typeof device.powerW === 'number' ? h('span', { class: 'power' }, `${device.powerW.toFixed(0)} W`) : null),
  device.problem ? h('div', { class: 'problem' }, device.problem) : null);
}

function replica(r, devices) {
  const kv = typeof r.kvUsage === 'number' ? r.kvUsage : null;
  const where = r.devices.map((d) => `GPU ${devices.get(d)?.index ?? shortId(d)}`).join(', ');
  return h('div', {
    class: 'replica',
    'data-replica-id': r.id,
    'data-state': r.state,
    'data-running': r.running ?? '',
    'data-waiting': r.waiting ?? '',
    'data-kv': kv ?? '',
  },
  h('div', { class: 'replica-head' },
    h('span', { class: 'replica-name', title: r.id }, r.deployment),
    h('span', { class: 'badge', 'data-state': r.state }, r.state)),
  h('div', { class: 'replica-stats' },
    h('span', {}, where || 'no GPU'),
    h('span', {}, `running ${r.running ?? '–'}`),
    h('span', {}, `waiting ${r.waiting ?? '–'}`),
    r.restarts ? h('span', {}, `restarts ${r.restarts}`) : null),
  kv !== null ? bar(kv, `KV cache ${pct(kv * 100)}`, 'kv') : null,
  r.error ? h('div', { class: 'problem' }, r.error) : null);
}

function nodeCard(record, theirOps, work) {
  const reachable = record.reachable !== false;
  const cordoned = !!record.cordoned;
  const devices = new Map((record.devices || []).map((d) => [d.id, d]));
  const grouped = new Set();
  const domains = (record.domains || []).map((domain) => {
    const members = domain.devices.map((id) => devices.get(id)).filter(Boolean);
    members.forEach((d) => grouped.add(d.id));
    return h('div', { class: 'domain', 'data-domain-id': domain.id },
      h('div', { class: 'domain-head' }, `${domain.kind || 'domain'} · ${domain.label || shortId(domain.id)}`),
      h('div', { class: 'gpus' }, members.map(gpu)));
  });
  const loose = (record.devices || []).filter((d) => !grouped.has(d.id));
  const engines = (record.engines || []).map((e) => h('li', { class: 'engine', 'data-up': String(e.up !== false) },
    `${e.name} (${e.kind}) ${e.up === false ? 'down' : 'up'}`, e.models?.length ? ` · ${e.models.join(', ')}` : ''));
  return h('article', {
    class: 'node card',
    'data-node-id': record.nodeId,
    'data-reachable': String(reachable),
    'data-cordoned': String(cordoned),
  },
  h('header', {},
    h('h3', { title: record.nodeId }, record.name, record.nodeId === shared.selfId ? ' (this node)' : ''),
    h('span', { class: 'reachable flag', 'data-on': String(reachable) }, reachable ? 'reachable' : 'unreachable'),
    cordoned ? h('span', { class: 'cordoned flag', 'data-on': 'true' }, 'cordoned') : null,
    record.refused ? h('span', { class: 'refused flag', 'data-on': 'true', title: record.refused }, 'refused') : null,
    h('span', { class: 'meta release', 'data-release': record.release || record.version || '' },
      `nvpair ${record.release || record.version || '?'}`,
      record.wire ? ` (wire ${record.wire[0]}-${record.wire[1]})` : '',
      ` · ${(record.addresses || []).join(', ')}`)),
  record.refused ? h('p', { class: 'problem' }, record.refused) : null,
  theirOps.length ? h('ul', { class: 'node-ops' }, theirOps.map((op) => h('li', { 'data-phase': op.phase },
    `${op.kind} ${op.phase}`, op.waitingFor ? ` · waiting for ${op.waitingFor}` : ''))) : null,
  h('div', { class: 'pending' },
    work ? `placed here: ${work.queued} queued, ${work.running} running` : '',
    typeof record.queueLimit === 'number' ? ` · queue limit ${record.queueLimit}` : ''),
  record.gpuNote ? h('p', { class: 'problem' }, record.gpuNote) : null,
  h('div', { class: 'domains' }, domains,
    loose.length ? h('div', { class: 'gpus loose' }, loose.map(gpu)) : null),
  engines.length ? h('ul', { class: 'engines' }, engines) : null,
  (record.replicas || []).length
    ? h('div', { class: 'replicas' }, record.replicas.map((r) => replica(r, devices)))
    : h('p', { class: 'empty' }, 'no replicas'));
}

export function start() {}

export function show(on) {
  if (on) poller.start();
  else poller.stop();
}
