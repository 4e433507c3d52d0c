// Tenants and their API keys: list and create tenants (with their concurrency cap, scheduling
// weight and rate limits, read-only: set them with PATCH /admin/v1/tenants/{t} or
// `loraplex tenants set`); per
// tenant create and revoke keys, and delete the tenant (after a confirmation). A new key's secret is shown exactly once, with a copy button;
// the server keeps only its hash.

import { api, asList, enc } from "./api.js";
import { $, confirmAction, copyText, fill, formatTime, h, toast } from "./dom.js";

/** The "Tenants" view. `onTenantsChanged(names)` lets the app refresh its tenant selector. */
export class TenantsView {
  constructor(root, { onTenantsChanged, getTenant, setTenant }) {
    this.root = root;
    this.onTenantsChanged = onTenantsChanged;
    this.getTenant = getTenant;
    this.setTenant = setTenant;
    this.tenants = [];
    // keys created in this page session, shown when the server has no key listing route
    this.sessionKeys = new Map();
    $("#tenant-create-form", root).addEventListener("submit", (ev) => {
      ev.preventDefault();
      this.createTenant();
    });
    $("#key-create", root).addEventListener("click", () => this.createKey());
    $("#key-secret-copy", root).addEventListener("click", () => this.copySecret());
    $("#key-secret-dismiss", root).addEventListener("click", () => this.hideSecret());
  }

  async load() {
    try {
      this.tenants = asList(await api("GET", "/tenants"), "tenants");
    } catch (err) {
      fill($("#tenant-list-error", this.root), err.message);
      return this.tenants;
    }
    fill($("#tenant-list-error", this.root));
    this.renderTenants();
    this.onTenantsChanged(this.tenants.map(tenantName));
    await this.loadKeys();
    return this.tenants;
  }

  renderTenants() {
    const current = this.getTenant();
    const rows = this.tenants.map((t) => {
      const name = tenantName(t);
      return h(
        "tr",
        { class: name === current ? "selected" : null, dataset: { tenant: name } },
        h("td", {}, h("button", { class: "link", type: "button", onclick: () => this.setTenant(name) }, name)),
        h("td", {}, formatTime(t.created_at ?? t.created)),
        h("td", {}, t.max_concurrent_requests ?? "server default"),
        h("td", {}, String(t.scheduling_weight ?? 1)),
        h("td", {}, rateLimit(t.max_requests_per_minute)),
        h("td", {}, rateLimit(t.max_tokens_per_minute)),
        h("td", {}, h("button", { type: "button", class: "danger small", onclick: () => this.deleteTenant(name) }, "Delete"))
      );
    });
    const empty = h("tr", {}, h("td", { colspan: 7, class: "empty" }, "No tenants yet: create one above."));
    fill($("#tenant-rows", this.root), rows.length ? rows : empty);
  }

  async createTenant() {
    const input = $("#tenant-name", this.root);
    const name = input.value.trim();
    const errorBox = $("#tenant-create-error", this.root);
    fill(errorBox);
    if (!name) return;
    try {
      await api("POST", "/tenants", { name });
    } catch (err) {
      fill(errorBox, err.message);
      return;
    }
    input.value = "";
    toast(`Tenant ${name} created.`);
    this.setTenant(name);
    await this.load();
  }

  async deleteTenant(name) {
    const ok = await confirmAction({
      title: `Delete tenant ${name}?`,
      body:
        `Every API key of ${name} stops working, and every adapter and version of it is deleted ` +
        "(requests already running finish first). Its usage stays for billing. The name can never be " +
        "used for a new tenant. This cannot be undone.",
      confirmLabel: "Delete tenant",
      danger: true,
    });
    if (!ok) return;
    let answer;
    try {
      answer = await api("DELETE", `/tenants/${enc(name)}`);
    } catch (err) {
      fill($("#tenant-list-error", this.root), err.message);
      return;
    }
    toast(`Tenant ${name} deleted: ${answer.api_keys_revoked} key(s) revoked, ${answer.adapters_deleted} adapter(s) deleted.`);
    this.sessionKeys.delete(name);
    // select another tenant first, so every view reloads for it rather than for the deleted one
    if (this.getTenant() === name) {
      const next = this.tenants.map(tenantName).find((n) => n !== name) || "";
      await this.setTenant(next);
    }
    await this.load();
  }

  async loadKeys() {
    const tenant = this.getTenant();
    fill($("#keys-tenant", this.root), tenant || "no tenant selected");
    $("#key-create", this.root).disabled = !tenant;
    const rows = $("#key-rows", this.root);
    if (!tenant) {
      fill(rows);
      return;
    }
    let keys;
    let note = "";
    try {
      keys = asList(await api("GET", `/tenants/${enc(tenant)}/keys`), "keys");
    } catch (err) {
      if (err.status !== 404 && err.status !== 405) {
        fill($("#keys-error", this.root), err.message);
        return;
      }
      // No listing route: show the keys made here, so they can still be revoked.
      keys = this.sessionKeys.get(tenant) || [];
      note = "This server does not list keys; only keys created in this browser tab are shown.";
    }
    fill($("#keys-error", this.root));
    fill($("#keys-note", this.root), note);
    const body = keys.map((k) =>
      h(
        "tr",
        { dataset: { keyId: String(k.id) } },
        h("td", { class: "mono" }, String(k.id)),
        h("td", { class: "mono" }, k.prefix ? `${k.prefix}…` : "–"),
        h("td", {}, formatTime(k.created_at ?? k.created)),
        h("td", {}, k.revoked_at || k.revoked ? `revoked ${formatTime(k.revoked_at)}` : "active"),
        h(
          "td",
          {},
          k.revoked_at || k.revoked
            ? null
            : h("button", { type: "button", class: "danger small", onclick: () => this.revokeKey(tenant, k) }, "Revoke")
        )
      )
    );
    const empty = h("tr", {}, h("td", { colspan: 5, class: "empty" }, "No keys."));
    fill(rows, body.length ? body : empty);
  }

  async createKey() {
    const tenant = this.getTenant();
    if (!tenant) return;
    let answer;
    try {
      answer = await api("POST", `/tenants/${enc(tenant)}/keys`, {});
    } catch (err) {
      fill($("#keys-error", this.root), err.message);
      return;
    }
    const secret = answer.key ?? answer.secret;
    const list = this.sessionKeys.get(tenant) || [];
    list.push({ id: answer.id, prefix: answer.prefix ?? secret.slice(0, 8), created_at: answer.created_at ?? new Date().toISOString() });
    this.sessionKeys.set(tenant, list);
    this.showSecret(tenant, secret);
    await this.loadKeys();
  }

  showSecret(tenant, secret) {
    const box = $("#key-secret", this.root);
    fill($("#key-secret-tenant", box), tenant);
    $("#key-secret-value", box).value = secret;
    box.hidden = false;
  }

  hideSecret() {
    const box = $("#key-secret", this.root);
    $("#key-secret-value", box).value = "";
    box.hidden = true;
  }

  async copySecret() {
    const input = $("#key-secret-value", this.root);
    const ok = await copyText(input.value, input);
    toast(ok ? "Key copied to the clipboard." : "Copy failed: select the key and copy it by hand.", ok ? "info" : "error");
  }

  async revokeKey(tenant, key) {
    const ok = await confirmAction({
      title: "Revoke key?",
      body: `Key ${key.prefix ? key.prefix + "…" : key.id} of tenant ${tenant} stops working at once. This cannot be undone.`,
      confirmLabel: "Revoke",
      danger: true,
    });
    if (!ok) return;
    try {
      await api("DELETE", `/tenants/${enc(tenant)}/keys/${enc(key.id)}`);
    } catch (err) {
      fill($("#keys-error", this.root), err.message);
      return;
    }
    const list = this.sessionKeys.get(tenant) || [];
    for (const k of list) if (String(k.id) === String(key.id)) k.revoked_at = new Date().toISOString();
    toast("Key revoked.");
    await this.loadKeys();
  }
}

export function tenantName(t) {
  return typeof t === "string" ? t : t.name;
}

/** A per-minute rate limit as the tenants table shows it (null: no limit). */
function rateLimit(value) {
  return value == null ? "unlimited" : String(value);
}
