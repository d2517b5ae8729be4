// Small helpers: DOM building (text only, never HTML from data), the JSON API, formatting.

export class LoginNeeded extends Error {}

export function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === undefined || value === null || value === false) continue;
    if (key.startsWith("on")) el.addEventListener(key.slice(2), value);
    else if (key === "dataset") Object.assign(el.dataset, value);
    else el.setAttribute(key, value === true ? "" : value);
  }
  for (const child of children.flat()) {
    if (child === undefined || child === null || child === false) continue;
    el.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return el;
}

export async function api(path, options = {}) {
  const response = await fetch("api/" + path, { credentials: "same-origin", ...options });
  if (response.status === 401) throw new LoginNeeded((await response.json()).message);
  const body = await response.json();
  if (!response.ok) throw new Error(`${body.error}: ${body.message}`);
  return body;
}

export function duration(seconds) {
  if (seconds === null || seconds === undefined) return "never";
  const s = Math.max(0, Math.round(seconds));
  if (s < 90) return `${s}s`;
  if (s < 5400) return `${Math.round(s / 60)}m`;
  if (s < 172800) return `${Math.floor(s / 3600)}h${String(Math.round((s % 3600) / 60)).padStart(2, "0")}m`;
  return `${Math.round(s / 86400)}d`;
}

export function ms(seconds) {
  return seconds === null || seconds === undefined ? "–" : `${(seconds * 1000).toFixed(seconds < 0.01 ? 1 : 0)} ms`;
}

export function errorBox(error) {
  return h("p", { class: "error" }, String(error.message || error));
}

export function kvTable(pairs) {
  return h("table", { class: "kv" }, Object.entries(pairs).map(([k, v]) =>
    h("tr", {}, h("td", {}, k), h("td", {}, typeof v === "object" && v !== null ? JSON.stringify(v) : String(v ?? "–")))));
}

export function labels(map) {
  return Object.entries(map || {}).map(([k, v]) => h("span", { class: "label" }, `${k}=${v}`));
}
