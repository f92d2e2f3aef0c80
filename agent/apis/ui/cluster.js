// The Cluster view: the pins (/v1/members: who joined when, who was removed and by whom)
// and the operations this node keeps (/v1/ops: cordon, uncordon, drain, their phase).

import { getJSON } from './api.js';
import { h, fmtTime } from './dom.js';
import { shared, showError, Poller } from './shared.js';

const poller = new Poller(4000, refresh);

async function refresh() {
  const error = document.getElementById('cluster-error');
  let members;
  let ops;
  try {
    [members, ops] = await Promise.all([getJSON('/v1/members'), getJSON('/v1/ops')]);
    showError(error, '');
  } catch (exc) {
    showError(error, `Cluster: ${exc.message}`);
    return;
  }
  document.querySelector('#members tbody').replaceChildren(...members.map((m) => h('tr', {
    class: 'member',
    'data-node-id': m.nodeId,
    'data-removed': String(!!m.removed),
  },
  h('td', { class: 'name' }, m.name, m.nodeId === shared.selfId ? ' (this node)' : ''),
  h('td', { class: 'node-id' }, h('code', {}, m.nodeId)),
  h('td', { class: 'pin' }, h('code', { title: 'SHA-256 of its certificate\'s public key' }, m.pin)),
  h('td', { class: 'added' }, m.added ? h('time', { datetime: m.added }, fmtTime(m.added)) : '–'),
  h('td', { class: 'removal' }, m.removed
    ? [h('time', { datetime: m.removed }, fmtTime(m.removed)), m.removedBy ? ` by ${shared.nodeName(m.removedBy) || m.removedBy}` : '']
    : '–'))));
  const box = document.getElementById('operations');
  box.replaceChildren(...ops.map((op) => h('article', { class: 'operation card', 'data-id': op.id, 'data-phase': op.phase },
    h('header', {},
      h('h3', {}, `${op.kind} ${shared.nodeName(op.target)}`),
      h('span', { class: 'badge phase', 'data-phase': op.phase }, op.phase)),
    op.waitingFor ? h('p', { class: 'waiting' }, `waiting for ${typeof op.waitingFor === 'string' ? op.waitingFor : JSON.stringify(op.waitingFor)}`) : null,
    op.result ? h('p', { class: 'result' }, op.result) : null,
    h('p', { class: 'meta' }, `${op.id} · asked by ${op.requester || '?'}`, op.reason ? ` · ${op.reason}` : '',
      ` · started ${fmtTime(op.createdAt * 1000)} · updated ${fmtTime(op.updatedAt * 1000)}`))));
  document.getElementById('operations-empty').hidden = ops.length > 0;
}

export function start() {}

export function show(on) {
  if (on) poller.start();
  else poller.stop();
}
