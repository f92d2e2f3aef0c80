// The Jobs stream (`/v1/jobs/stream`): one EventSource, its state in #conn. The browser's own
// reconnects send Last-Event-ID and the agent resumes without gap or repeat; a new
// EventSource (after the browser gave up) carries none, so the list is read again.

export function follow({ job, reset }) {
  const conn = document.getElementById('conn');
  const set = (state) => {
    conn.dataset.state = state;
    conn.textContent = state;
  };
  let backoff = 1000;
  const open = () => {
    const source = new EventSource('/v1/jobs/stream');
    let fresh = true;
    source.addEventListener('open', () => {
      set('live');
      backoff = 1000;
      if (fresh) {
        fresh = false;
        reset();
      }
    });
    source.addEventListener('job', (event) => {
      let record;
      try {
        record = JSON.parse(event.data);
      } catch (_) {
        return;
      }
      if (record && typeof record === 'object' && record.originatedFrom && record.runId && record.id !== undefined) {
        job(record);
      }
    });
    source.addEventListener('reset', () => reset());
    source.addEventListener('error', () => {
      set('reconnecting');
      if (source.readyState === EventSource.CLOSED) {
        setTimeout(open, backoff);
        backoff = Math.min(backoff * 2, 30000);
      }
    });
  };
  open();
}
