// DOM and formatting helpers. Text from the API only ever goes in as text nodes or as
// attribute values set one by one, never parsed as markup: a model name or an error string
// stays text.

/** An element: h('td', {class: 'model', 'data-x': 1}, 'text', child, ...). */
export function h(tag, attrs, ...children) {
  const svg = SVG_TAGS.has(tag);
  const el = svg ? document.createElementNS(SVG_NS, tag) : document.createElement(tag);
  for (const [name, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (/^on|^style$/i.test(name)) throw new Error(`no ${name} attribute: handlers and styles are set in code`);
    el.setAttribute(name, value === true ? '' : String(value));
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined || child === false) continue;
    el.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return el;
}

const SVG_NS = 'http://www.w3.org/2000/svg';
const SVG_TAGS = new Set(['svg', 'g', 'path', 'line', 'rect', 'text', 'title', 'polyline', 'circle']);

/** Replace an element's children. */
export function fill(el, ...children) {
  el.replaceChildren();
  for (const child of children.flat()) {
    if (child !== null && child !== undefined && child !== false) el.append(child);
  }
}

export function fmtBytes(n) {
  if (typeof n !== 'number' || !isFinite(n)) return '–';
  const gib = n / 2 ** 30;
  if (gib >= 1) return `${gib.toFixed(gib >= 100 ? 0 : 1)} GiB`;
  return `${(n / 2 ** 20).toFixed(0)} MiB`;
}

export function fmtMs(ms) {
  if (typeof ms !== 'number' || !isFinite(ms) || ms < 0) return '–';
  if (ms < 1000) return `${Math.round(ms)} ms`;
  if (ms < 60000) return `${(ms / 1000).toFixed(1)} s`;
  if (ms < 3600000) return `${Math.floor(ms / 60000)} min ${Math.round((ms % 60000) / 1000)} s`;
  return `${(ms / 3600000).toFixed(1)} h`;
}

export function fmtCount(n) {
  if (typeof n !== 'number' || !isFinite(n)) return '–';
  if (n >= 1e6) return `${(n / 1e6).toFixed(1)}M`;
  if (n >= 1e4) return `${(n / 1e3).toFixed(1)}k`;
  return String(Math.round(n));
}

/** A date from epoch ms (a number) or an ISO string, as local time. */
export function fmtTime(value) {
  if (value === null || value === undefined || value === '') return '–';
  const date = new Date(value);
  if (isNaN(date.getTime())) return '–';
  return date.toLocaleString(undefined, {
    year: 'numeric', month: 'short', day: 'numeric', hour: '2-digit', minute: '2-digit', second: '2-digit',
  });
}

/** A short id for a cell: the tail of a long id, the whole id in the title. */
export function shortId(id) {
  const s = String(id ?? '');
  return s.length > 14 ? `…${s.slice(-8)}` : s;
}
