// Adapters of one tenant: the table (active version, versions, rank, targets, size, tier,
// requests, tokens), and per adapter its versions with hot-swap, plus load / pin / unload / delete.

import { api, asList, enc } from "./api.js";
import { $, confirmAction, fill, formatBytes, formatNumber, formatTime, h, toast } from "./dom.js";

// Fields of the version an adapter row describes (the active one, else the newest).
function shownVersion(adapter) {
  const versions = adapterVersions(adapter);
  const active = activeVersion(adapter);
  return versions.find((v) => versionNumber(v) === active) || versions[versions.length - 1] || {};
}

export function adapterVersions(adapter) {
  const versions = asList(adapter.versions, "versions");
  return [...versions].sort((a, b) => versionNumber(a) - versionNumber(b));
}

export function versionNumber(v) {
  return Number(v.version ?? v.number);
}

function activeVersion(adapter) {
  const v = adapter.active_version ?? adapter.active;
  if (v && typeof v === "object") return versionNumber(v);
  return v === null || v === undefined ? null : Number(v);
}

function targetsText(targets) {
  if (!targets) return "–";
  return Array.isArray(targets) ? targets.join(", ") : String(targets);
}

function tierBadge(tier, pinned) {
  const name = tier || "store";
  return h("span", { class: `badge tier-${name}` }, name, pinned ? " · pinned" : "");
}

/** The "Adapters" view for the tenant the app has selected. */
export class AdaptersView {
  constructor(root, { getTenant, onUploadVersion, onChanged }) {
    this.root = root;
    this.getTenant = getTenant;
    this.onUploadVersion = onUploadVersion;
    this.onChanged = onChanged;
    this.adapters = [];
    this.expanded = new Set();
  }

  async load() {
    const tenant = this.getTenant();
    fill($("#adapters-tenant", this.root), tenant || "no tenant selected");
    fill($("#upload-tenant-hint", this.root), tenant || "the selected tenant");
    const errorBox = $("#adapters-error", this.root);
    if (!tenant) {
      this.adapters = [];
      this.render();
      return;
    }
    try {
      this.adapters = asList(await api("GET", `/tenants/${enc(tenant)}/adapters`), "adapters");
    } catch (err) {
      fill(errorBox, err.message);
      return;
    }
    fill(errorBox);
    this.render();
  }

  render() {
    const tenant = this.getTenant();
    const rows = [];
    for (const adapter of this.adapters) {
      const v = shownVersion(adapter);
      const open = this.expanded.has(adapter.name);
      rows.push(
        h(
          "tr",
          { class: "adapter-row", dataset: { adapter: adapter.name } },
          h(
            "td",
            {},
            h(
              "button",
              { type: "button", class: "link", "aria-expanded": open ? "true" : "false", onclick: () => this.toggle(adapter.name) },
              open ? "▾ " : "▸ ",
              adapter.name
            )
          ),
          h("td", { class: "col-active" }, activeVersion(adapter) ?? "–"),
          h("td", { class: "col-versions" }, adapterVersions(adapter).length),
          h("td", {}, v.rank ?? adapter.rank ?? "–"),
          h("td", { class: "targets" }, targetsText(v.targets ?? adapter.targets)),
          h("td", { class: "nowrap" }, formatBytes(v.size_bytes ?? v.bytes ?? adapter.size_bytes)),
          h("td", { class: "col-tier" }, tierBadge(adapter.tier ?? v.tier, adapter.pinned ?? v.pinned)),
          h("td", { class: "col-requests num" }, formatNumber(adapter.requests ?? v.requests)),
          h("td", { class: "col-tokens num" }, formatNumber(adapter.tokens ?? v.tokens))
        )
      );
      if (open) rows.push(this.detailRow(tenant, adapter));
    }
    const empty = h("tr", {}, h("td", { colspan: 9, class: "empty" }, tenant ? "No adapters yet: upload one above." : "Select a tenant."));
    fill($("#adapter-rows", this.root), rows.length ? rows : empty);
  }

  toggle(name) {
    if (this.expanded.has(name)) this.expanded.delete(name);
    else this.expanded.add(name);
    this.render();
  }

  detailRow(tenant, adapter) {
    const active = activeVersion(adapter);
    const versionRows = adapterVersions(adapter).map((v) => {
      const n = versionNumber(v);
      const isActive = n === active;
      return h(
        "tr",
        { class: isActive ? "version-row active" : "version-row", dataset: { version: String(n) } },
        h("td", { class: "nowrap" }, `v${n}`, isActive ? h("span", { class: "badge active" }, "active") : null),
        h("td", { class: "mono", title: v.sha256 || "" }, v.sha256 ? v.sha256.slice(0, 12) : "–"),
        h("td", {}, v.rank ?? "–"),
        h("td", { class: "targets" }, targetsText(v.targets)),
        h("td", { class: "nowrap" }, formatBytes(v.size_bytes ?? v.bytes)),
        h("td", { class: "col-tier" }, v.tier ? tierBadge(v.tier, v.pinned) : "–"),
        h("td", { class: "num col-requests" }, formatNumber(v.requests)),
        h("td", { class: "num col-tokens" }, formatNumber(v.tokens)),
        h("td", { class: "nowrap" }, formatTime(v.created_at ?? v.created)),
        h("td", {}, v.uploader ?? "–"),
        h(
          "td",
          { class: "actions" },
          isActive
            ? null
            : h("button", { type: "button", class: "small", onclick: () => this.activate(tenant, adapter, n) }, "Activate"),
          isActive
            ? null
            : h("button", { type: "button", class: "small danger", onclick: () => this.deleteVersion(tenant, adapter, n) }, "Delete")
        )
      );
    });
    const actions = h(
      "div",
      { class: "adapter-actions" },
      h("button", { type: "button", onclick: () => this.loadTo(tenant, adapter, "device", false) }, "Load to device"),
      h("button", { type: "button", onclick: () => this.loadTo(tenant, adapter, "host", false) }, "Load to host"),
      h("button", { type: "button", onclick: () => this.loadTo(tenant, adapter, "device", true) }, "Pin on device"),
      h("button", { type: "button", onclick: () => this.unload(tenant, adapter) }, "Unload"),
      h("button", { type: "button", onclick: () => this.onUploadVersion(adapter.name) }, "Upload new version"),
      h("button", { type: "button", class: "danger", onclick: () => this.deleteAdapter(tenant, adapter) }, "Delete adapter")
    );
    const table = h(
      "table",
      { class: "versions" },
      h(
        "thead",
        {},
        h("tr", {}, ["Version", "sha256", "Rank", "Targets", "Size", "Tier", "Requests", "Tokens", "Uploaded", "By", ""].map((t) =>
          h("th", { class: t === "Requests" || t === "Tokens" ? "num" : null }, t)
        ))
      ),
      h("tbody", {}, versionRows)
    );
    return h("tr", { class: "adapter-detail", dataset: { adapter: adapter.name } }, h("td", { colspan: 9 }, actions, table));
  }

  async run(action, doneMessage) {
    try {
      await action();
    } catch (err) {
      fill($("#adapters-error", this.root), err.message);
      toast(err.message, "error");
      return false;
    }
    fill($("#adapters-error", this.root));
    toast(doneMessage);
    await this.load();
    this.onChanged();
    return true;
  }

  async activate(tenant, adapter, version) {
    const ok = await confirmAction({
      title: `Activate ${adapter.name} v${version}?`,
      body:
        `Requests to "${adapter.name}" admitted from now on use version ${version} ` +
        `(now v${activeVersion(adapter) ?? "–"}). Requests already running finish on the version they started with.`,
      confirmLabel: `Activate v${version}`,
    });
    if (!ok) return;
    await this.run(
      () => api("PUT", `/tenants/${enc(tenant)}/adapters/${enc(adapter.name)}/active`, { version }),
      `${adapter.name} now serves v${version}.`
    );
  }

  async loadTo(tenant, adapter, tier, pin) {
    await this.run(
      () => api("POST", `/tenants/${enc(tenant)}/adapters/${enc(adapter.name)}/load`, { tier, pin }),
      pin ? `${adapter.name} pinned on ${tier}.` : `${adapter.name} loaded to ${tier}.`
    );
  }

  async unload(tenant, adapter) {
    await this.run(
      () => api("POST", `/tenants/${enc(tenant)}/adapters/${enc(adapter.name)}/unload`, {}),
      `${adapter.name} unloaded.`
    );
  }

  async deleteVersion(tenant, adapter, version) {
    const ok = await confirmAction({
      title: `Delete ${adapter.name} v${version}?`,
      body: "Requests using this version finish first; then its files are removed. This cannot be undone.",
      confirmLabel: "Delete version",
      danger: true,
    });
    if (!ok) return;
    await this.run(
      () => api("DELETE", `/tenants/${enc(tenant)}/adapters/${enc(adapter.name)}/versions/${enc(version)}`),
      `${adapter.name} v${version} deleted.`
    );
  }

  async deleteAdapter(tenant, adapter) {
    const ok = await confirmAction({
      title: `Delete adapter ${adapter.name}?`,
      body: "All its versions are deleted; requests using it finish first. This cannot be undone.",
      confirmLabel: "Delete adapter",
      danger: true,
    });
    if (!ok) return;
    this.expanded.delete(adapter.name);
    await this.run(() => api("DELETE", `/tenants/${enc(tenant)}/adapters/${enc(adapter.name)}`), `${adapter.name} deleted.`);
  }
}
