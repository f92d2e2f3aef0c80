// What the views share: this node, the members' names, pollers that run only while shown.

import { getJSON } from './api.js';

export const shared = {
  selfId: '',
  selfName: '',
  nodes: new Map(), // nodeId -> the member's record, from /v1/nodes
  async refreshNodes() {
    try {
      this.setNodes(await getJSON('/v1/nodes'));
    } catch (_) { /* the Nodes view shows why */ }
  },
  setNodes(records) {
    this.nodes = new Map(records.map((n) => [n.nodeId, n]));
    const list = document.getElementById('known-nodes');
    if (list) {
      list.replaceChildren(...records.map((n) => {
        const option = document.createElement('option');
        option.value = n.name;
        return option;
      }));
    }
  },
  nodeName(id) {
    if (!id) return '';
    return this.nodes.get(id)?.name || id;
  },
  /** A node id for what a person typed: a member's name or an id. */
  nodeIdFor(text) {
    for (const [id, node] of this.nodes) if (node.name === text) return id;
    return text;
  },
};

/** Show or hide an error line. */
export function showError(el, message) {
  el.textContent = message || '';
  el.hidden = !message;
}

/** Calls `tick` every `ms` while running; start() ticks at once; no overlap. */
export class Poller {
  constructor(ms, tick) {
    this.ms = ms;
    this.tick = tick;
    this.timer = null;
    this.running = false;
  }
  start() {
    if (this.running) return;
    this.running = true;
    this.loop();
  }
  stop() {
    this.running = false;
    clearTimeout(this.timer);
  }
  async loop() {
    if (!this.running || this.busy) return;
    this.busy = true;
    try { await this.tick(); } catch (exc) { console.error(exc); } finally { this.busy = false; }
    clearTimeout(this.timer);
    if (this.running) this.timer = setTimeout(() => this.loop(), this.ms);
  }
  now() {
    clearTimeout(this.timer);
    if (this.running) this.loop();
  }
}
