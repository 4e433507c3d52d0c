// Talks to the admin API (/admin/v1). The admin key lives in sessionStorage only: it is sent as
// a bearer header, never put in a URL or a cookie.

const KEY_STORAGE = "loraplex.adminKey";
// Relative to this file (<root>/admin/js/api.js), not "/admin/v1": behind a proxy that serves the
// server under a path prefix (`--root-path /llm`), the API is at /llm/admin/v1.
export const API_BASE = new URL("../v1", import.meta.url).pathname;

/** An error answered by the server, carrying its OpenAI-style envelope's message. */
export class ApiError extends Error {
  constructor(status, message, code = null, param = null) {
    super(message);
    this.status = status;
    this.code = code;
    this.param = param;
  }
}

export function getAdminKey() {
  return sessionStorage.getItem(KEY_STORAGE);
}

export function setAdminKey(key) {
  sessionStorage.setItem(KEY_STORAGE, key);
}

export function clearAdminKey() {
  sessionStorage.removeItem(KEY_STORAGE);
}

// Turn any error body into words: the envelope's message, or the raw text, or the status.
function errorFromBody(status, text) {
  let message = text && text.trim() ? text.trim() : `HTTP ${status}`;
  let code = null;
  let param = null;
  try {
    const body = JSON.parse(text);
    const err = body && (body.error || body);
    if (typeof err === "string") message = err;
    else if (err && err.message) {
      message = err.message;
      code = err.code ?? null;
      param = err.param ?? null;
    } else if (body && body.detail) message = String(body.detail);
  } catch (_) {
    // not JSON: keep the text
  }
  return new ApiError(status, message, code, param);
}

let onUnauthorized = () => {};

/** Called whenever the server answers 401 (key wrong or revoked): the app signs out. */
export function setUnauthorizedHandler(fn) {
  onUnauthorized = fn;
}

/** JSON request against the admin API; resolves to the parsed body (or null for 204). */
export async function api(method, path, body, { key = getAdminKey() } = {}) {
  const headers = { Accept: "application/json" };
  if (key) headers.Authorization = `Bearer ${key}`;
  const init = { method, headers, credentials: "omit", cache: "no-store" };
  if (body !== undefined) {
    headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  const res = await fetch(API_BASE + path, init);
  const text = await res.text();
  if (!res.ok) {
    const err = errorFromBody(res.status, text);
    if (res.status === 401) onUnauthorized(err);
    throw err;
  }
  if (!text) return null;
  return JSON.parse(text);
}

/** Lists come back either bare or wrapped ({"data": [...]}, {"tenants": [...]}, ...). */
export function asList(body, ...names) {
  if (Array.isArray(body)) return body;
  if (!body || typeof body !== "object") return [];
  for (const name of ["data", ...names]) {
    if (Array.isArray(body[name])) return body[name];
  }
  return [];
}

export const enc = encodeURIComponent;

/**
 * Upload files with XMLHttpRequest so the bar can follow the bytes (fetch has no upload
 * progress). `fields` is a list of [fieldName, File]. Resolves to the parsed JSON answer.
 */
export function uploadForm(path, fields, onProgress) {
  return new Promise((resolve, reject) => {
    const form = new FormData();
    for (const [name, file] of fields) form.append(name, file, file.name);
    const xhr = new XMLHttpRequest();
    xhr.open("POST", API_BASE + path);
    xhr.withCredentials = false;
    xhr.setRequestHeader("Authorization", `Bearer ${getAdminKey()}`);
    xhr.setRequestHeader("Accept", "application/json");
    xhr.upload.onprogress = (ev) => {
      if (ev.lengthComputable) onProgress(ev.loaded, ev.total);
    };
    xhr.onload = () => {
      if (xhr.status >= 200 && xhr.status < 300) {
        try {
          resolve(xhr.responseText ? JSON.parse(xhr.responseText) : null);
        } catch (e) {
          reject(new ApiError(xhr.status, "The server answered with something that is not JSON."));
        }
      } else {
        const err = errorFromBody(xhr.status, xhr.responseText);
        if (xhr.status === 401) onUnauthorized(err);
        reject(err);
      }
    };
    xhr.onerror = () => reject(new ApiError(0, "The upload failed: the connection was lost."));
    xhr.onabort = () => reject(new ApiError(0, "The upload was cancelled."));
    xhr.send(form);
  });
}
