// The page: five views over the local API, each a module with start() (called once, when the
// view is first shown) and show(visible). Only the visible view polls.

import { getJSON, whenSignedOut } from './api.js';
import * as jobs from './jobs.js';
import * as nodes from './nodes.js';
import * as deployments from './deployments.js';
import * as usage from './usage.js';
import * as cluster from './cluster.js';
import { shared } from './shared.js';

const VIEWS = { jobs, nodes, deployments, usage, cluster };
const started = new Set();
let current = null;

function select(name) {
  if (!(name in VIEWS)) name = 'jobs';
  for (const button of document.querySelectorAll('nav [data-view]')) {
    if (button.dataset.view === name) button.setAttribute('aria-current', 'page');
    else button.removeAttribute('aria-current');
  }
  for (const view of Object.keys(VIEWS)) {
    document.getElementById(`view-${view}`).hidden = view !== name;
  }
  if (current && current !== name) VIEWS[current].show(false);
  current = name;
  if (!started.has(name)) {
    started.add(name);
    VIEWS[name].start();
  }
  VIEWS[name].show(true);
  if (location.hash !== `#${name}`) history.replaceState(null, '', `#${name}`);
}

async function main() {
  whenSignedOut(() => { document.getElementById('signed-out').hidden = false; });
  for (const button of document.querySelectorAll('nav [data-view]')) {
    button.addEventListener('click', () => select(button.dataset.view));
  }
  try {
    const health = await getJSON('/healthz');
    shared.selfId = health.nodeId;
    shared.selfName = health.name;
    document.getElementById('node-name').textContent = `nvpair · ${health.name}`;
    document.title = `nvpair · ${health.name}`;
  } catch (_) { /* shown by the views' own errors */ }
  await shared.refreshNodes();
  // The Jobs stream runs whatever the view: #conn always tells its state.
  jobs.connect();
  started.add('jobs');
  jobs.start();
  select(location.hash.slice(1) || 'jobs');
}

if (document.readyState === 'loading') document.addEventListener('DOMContentLoaded', main);
else main();
