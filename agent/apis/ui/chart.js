// Small SVG charts drawn here: lines over time buckets, or a few labelled bars.

import { h, fmtCount } from './dom.js';

const W = 600;
const H = 180;
const PAD = { left: 62, right: 8, top: 10, bottom: 22 };
export const PALETTE = 8; // colours in app.css: .s0 .. .s7

function niceMax(v) {
  if (!(v > 0)) return 1;
  const p = 10 ** Math.floor(Math.log10(v));
  for (const m of [1, 2, 2.5, 5, 10]) if (m * p >= v) return m * p;
  return 10 * p;
}

function axes(max, unit) {
  const out = [];
  for (let i = 0; i <= 4; i += 1) {
    const v = (max * i) / 4;
    const y = PAD.top + (H - PAD.top - PAD.bottom) * (1 - i / 4);
    out.push(h('line', { class: 'grid', x1: PAD.left, x2: W - PAD.right, y1: y, y2: y }));
    out.push(h('text', { class: 'tick', x: PAD.left - 4, y: y + 4, 'text-anchor': 'end' }, `${v % 1 ? v.toFixed(1) : fmtCount(v)}${unit}`));
  }
  return out;
}

/** Lines: series = [{name, values: [...]}], the last value now, one bucket each `bucketS`. */
export function lines(svg, series, { windowS, bucketS, unit = '' }) {
  const n = Math.max(1, ...series.map((s) => s.values.length));
  const max = niceMax(Math.max(0, ...series.flatMap((s) => s.values.filter(Number.isFinite))));
  const x = (i) => PAD.left + ((W - PAD.left - PAD.right) * i) / Math.max(1, n - 1);
  const y = (v) => PAD.top + (H - PAD.top - PAD.bottom) * (1 - v / max);
  const parts = axes(max, unit);
  const span = windowS >= 86400 ? 'a day ago' : windowS >= 3600 ? 'an hour ago' : `${windowS} s ago`;
  parts.push(h('text', { class: 'tick', x: PAD.left, y: H - 6 }, span));
  parts.push(h('text', { class: 'tick', x: W - PAD.right, y: H - 6, 'text-anchor': 'end' }, 'now'));
  series.forEach((s, k) => {
    const points = s.values.map((v, i) => `${x(i).toFixed(1)},${y(Number.isFinite(v) ? v : 0).toFixed(1)}`);
    parts.push(h('polyline', { class: `line s${k % PALETTE}`, points: points.join(' '), 'data-name': s.name },
      h('title', {}, `${s.name}: ${fmtCount(s.values.reduce((a, b) => a + (Number.isFinite(b) ? b : 0), 0))} in all`)));
  });
  if (!series.length) parts.push(h('text', { class: 'tick', x: W / 2, y: H / 2, 'text-anchor': 'middle' }, 'nothing yet'));
  svg.setAttribute('data-buckets', String(n));
  svg.setAttribute('data-bucket-s', String(bucketS ?? ''));
  svg.replaceChildren(...parts);
}

/** Bars: items = [{name, value}] side by side. */
export function bars(svg, items, { unit = '' } = {}) {
  const max = niceMax(Math.max(0, ...items.map((i) => i.value).filter(Number.isFinite)));
  const parts = axes(max, unit);
  const inner = W - PAD.left - PAD.right;
  const slot = inner / Math.max(1, items.length);
  items.forEach((item, k) => {
    const v = Number.isFinite(item.value) ? item.value : 0;
    const top = PAD.top + (H - PAD.top - PAD.bottom) * (1 - v / max);
    const x = PAD.left + slot * k + slot * 0.2;
    parts.push(h('rect', { class: `col s${k % PALETTE}`, x, y: top, width: slot * 0.6,
      height: H - PAD.bottom - top, 'data-name': item.name, 'data-value': Number.isFinite(item.value) ? item.value : '' },
    h('title', {}, `${item.name}: ${Number.isFinite(item.value) ? `${Math.round(item.value)}${unit}` : 'none'}`)));
    parts.push(h('text', { class: 'tick', x: x + slot * 0.3, y: H - 6, 'text-anchor': 'middle' },
      `${item.name} ${Number.isFinite(item.value) ? `${Math.round(item.value)}${unit}` : '–'}`));
  });
  svg.replaceChildren(...parts);
}
