// Every request goes to the page's own origin with the session cookie. The local API answers
// refusals with {error}; some routes answer a plain-text reason: both become an ApiError.

export class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

async function reason(response) {
  const text = (await response.text()).slice(0, 2000);
  try {
    const body = JSON.parse(text);
    if (body && typeof body.error === 'string') return body.error;
    if (body && body.error && typeof body.error.message === 'string') return body.error.message;
  } catch (_) { /* a plain-text reason */ }
  return text.trim() || `${response.status} ${response.statusText}`;
}

async function call(path, init) {
  let response;
  try {
    response = await fetch(path, { credentials: 'same-origin', cache: 'no-store', ...init });
  } catch (exc) {
    throw new ApiError(0, `the agent does not answer (${exc.message})`);
  }
  if (response.status === 401) signedOut();
  if (!response.ok) throw new ApiError(response.status, await reason(response));
  return response.json();
}

/** GET a JSON answer; `query` drops empty values. */
export function getJSON(path, query) {
  const params = new URLSearchParams();
  for (const [k, v] of Object.entries(query || {})) {
    if (v !== null && v !== undefined && v !== '') params.set(k, String(v));
  }
  const qs = params.toString();
  return call(qs ? `${path}?${qs}` : path, { method: 'GET' });
}

/** POST a JSON body (the guard takes only application/json). */
export function postJSON(path, body) {
  return call(path, {
    method: 'POST',
    headers: { 'Content-Type': 'application/json' },
    body: JSON.stringify(body ?? {}),
  });
}

let onSignedOut = () => {};
export function whenSignedOut(fn) { onSignedOut = fn; }
function signedOut() { onSignedOut(); }
