// Each job's tokens are kept on the member it came in through (`POST /v1/usage`, the rows
// `nvpair jobs --usage` reads): asked in batches for the finished jobs shown that came in
// here, once more a little later for those not written yet, then left as `–`.

import { postJSON } from './api.js';
import { shared } from './shared.js';

const FINAL = new Set(['completed', 'failed', 'cancelled']);
const BATCH = 1000; // jobs per ask (the route takes up to 10,000)

export class JobTokens {
  /** `rows`: the Jobs view's key -> {job, tr}; `found(row)` redraws a row's tokens. */
  constructor(rows, keyOf, found) {
    this.rows = rows;
    this.keyOf = keyOf;
    this.found = found;
    this.known = new Map(); // key -> {promptTokens, completionTokens}
    this.asked = new Map(); // key -> times asked (bounded: cleared past 20,000)
    this.timer = null;
    this.works = true; // false once the agent has no such route
  }

  get(key) {
    return this.known.get(key) || null;
  }

  forget(key) {
    this.known.delete(key);
  }

  wanted(job) {
    if (!FINAL.has(job.state) || job.originatedFrom !== shared.selfId) return false;
    if (typeof job.promptTokens === 'number') return false; // the record carries them
    const key = this.keyOf(job);
    return !this.known.has(key) && (this.asked.get(key) || 0) < 2;
  }

  want(job) {
    if (this.works && this.wanted(job) && this.timer === null) {
      this.timer = setTimeout(() => this.ask(), 400);
    }
  }

  async ask() {
    this.timer = null;
    const jobs = [];
    for (const { job } of this.rows.values()) {
      if (!this.wanted(job)) continue;
      const key = this.keyOf(job);
      this.asked.set(key, (this.asked.get(key) || 0) + 1);
      jobs.push(job);
      if (jobs.length >= BATCH) break;
    }
    if (this.asked.size > 20000) this.asked.clear();
    if (!jobs.length) return;
    try {
      const answer = await postJSON('/v1/usage', { jobs: jobs.map((j) => [j.runId, j.id]) });
      for (const job of jobs) {
        const got = answer.usage?.[`${job.runId}/${job.id}`];
        const row = this.rows.get(this.keyOf(job));
        if (!got || !row) continue;
        this.known.set(this.keyOf(job), got);
        this.found(row);
      }
      // A usage row is written just after its job ends: ask once more for the missing.
      if (jobs.some((j) => this.wanted(j) && this.rows.has(this.keyOf(j)))) {
        this.timer = setTimeout(() => this.ask(), 2000);
      }
    } catch (exc) {
      if (exc.status === 404 || exc.status === 405) this.works = false;
    }
  }
}
