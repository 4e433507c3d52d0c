// Small DOM helpers. Text from the server always goes in through textContent (never innerHTML),
// so a tenant or adapter name cannot inject markup.

/** h("tr", {class: "x", onclick: fn}, child, "text", [more]) -> element */
export function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs || {})) {
    if (value === undefined || value === null || value === false) continue;
    if (name.startsWith("on") && typeof value === "function") {
      el.addEventListener(name.slice(2), value);
    } else if (name === "dataset") {
      Object.assign(el.dataset, value);
    } else if (value === true) {
      el.setAttribute(name, "");
    } else {
      el.setAttribute(name, String(value));
    }
  }
  append(el, children);
  return el;
}

function append(el, children) {
  for (const child of children) {
    if (child === undefined || child === null || child === false) continue;
    if (Array.isArray(child)) append(el, child);
    else if (child instanceof Node) el.appendChild(child);
    else el.appendChild(document.createTextNode(String(child)));
  }
}

/** Replace an element's children. */
export function fill(el, ...children) {
  el.replaceChildren();
  append(el, children);
  return el;
}

export const $ = (sel, root = document) => root.querySelector(sel);

export function formatBytes(n) {
  if (n === undefined || n === null || Number.isNaN(Number(n))) return "–";
  n = Number(n);
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) {
    n /= 1024;
    i += 1;
  }
  return `${n.toFixed(i === 0 ? 0 : 1)} ${units[i]}`;
}

export function formatNumber(n, digits = 0) {
  if (n === undefined || n === null || Number.isNaN(Number(n))) return "–";
  return Number(n).toLocaleString("en-US", { maximumFractionDigits: digits, minimumFractionDigits: digits });
}

/** ISO string or unix seconds -> "2026-12-02 16:40:12" in the browser's zone. */
export function formatTime(value) {
  if (value === undefined || value === null || value === "") return "–";
  const date = typeof value === "number" ? new Date(value * 1000) : new Date(value);
  if (Number.isNaN(date.getTime())) return String(value);
  const pad = (x) => String(x).padStart(2, "0");
  return (
    `${date.getFullYear()}-${pad(date.getMonth() + 1)}-${pad(date.getDate())} ` +
    `${pad(date.getHours())}:${pad(date.getMinutes())}:${pad(date.getSeconds())}`
  );
}

/** Show a short message at the bottom of the page. */
export function toast(message, kind = "info") {
  const box = $("#toasts");
  const item = h("div", { class: `toast toast-${kind}`, role: kind === "error" ? "alert" : "status" }, message);
  box.appendChild(item);
  setTimeout(() => item.remove(), kind === "error" ? 8000 : 4000);
}

/**
 * Ask before doing something that changes what is served. Resolves true on "confirm".
 * A real <dialog> (not window.confirm) so it can say exactly what will change.
 */
export function confirmAction({ title, body, confirmLabel = "Confirm", danger = false }) {
  const dialog = $("#confirm-dialog");
  fill($("#confirm-title", dialog), title);
  fill($("#confirm-body", dialog), body);
  const ok = $("#confirm-ok", dialog);
  ok.textContent = confirmLabel;
  ok.classList.toggle("danger", danger);
  return new Promise((resolve) => {
    const done = () => {
      dialog.removeEventListener("close", done);
      resolve(dialog.returnValue === "confirm");
    };
    dialog.returnValue = "";
    dialog.addEventListener("close", done);
    dialog.showModal();
  });
}

/** Copy text to the clipboard; falls back to selecting it where the API is not allowed. */
export async function copyText(text, fallbackInput) {
  try {
    await navigator.clipboard.writeText(text);
    return true;
  } catch (_) {
    if (fallbackInput) {
      fallbackInput.focus();
      fallbackInput.select();
      try {
        return document.execCommand("copy");
      } catch (__) {
        return false;
      }
    }
    return false;
  }
}
