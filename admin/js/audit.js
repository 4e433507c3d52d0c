// The audit log: who changed what, when (uploads, hot-swaps, loads, deletes, key changes).

import { api, asList, enc } from "./api.js";
import { $, fill, formatTime, h } from "./dom.js";

function detailText(detail) {
  if (detail === undefined || detail === null || detail === "") return "";
  if (typeof detail === "string") return detail;
  return Object.entries(detail)
    .map(([k, v]) => `${k}=${typeof v === "object" ? JSON.stringify(v) : v}`)
    .join(" ");
}

/** The "Audit log" view; filters to the selected tenant unless "all tenants" is ticked. */
export class AuditView {
  constructor(root, { getTenant }) {
    this.root = root;
    this.getTenant = getTenant;
    $("#audit-all", root).addEventListener("change", () => this.load());
    $("#audit-refresh", root).addEventListener("click", () => this.load());
  }

  async load() {
    const all = $("#audit-all", this.root).checked;
    const tenant = this.getTenant();
    const query = !all && tenant ? `?tenant=${enc(tenant)}&limit=200` : "?limit=200";
    fill($("#audit-scope", this.root), !all && tenant ? `tenant ${tenant}` : "all tenants");
    let events;
    try {
      events = asList(await api("GET", `/audit${query}`), "events", "audit");
    } catch (err) {
      const why = err.status === 404 ? "This server has no audit log route (GET /admin/v1/audit)." : err.message;
      fill($("#audit-error", this.root), why);
      return;
    }
    fill($("#audit-error", this.root));
    const rows = events.map((e) =>
      h(
        "tr",
        { dataset: { action: e.action ?? "" } },
        h("td", { class: "nowrap" }, formatTime(e.at ?? e.created_at ?? e.timestamp ?? e.time)),
        h("td", {}, e.actor ?? "–"),
        h("td", {}, h("span", { class: "badge" }, e.action ?? "–")),
        h("td", {}, e.tenant ?? "–"),
        h("td", {}, [e.object_type, e.object_name].filter(Boolean).join(" ") || "–"),
        h("td", { class: "detail" }, detailText(e.detail))
      )
    );
    const empty = h("tr", {}, h("td", { colspan: 6, class: "empty" }, "No events."));
    fill($("#audit-rows", this.root), rows.length ? rows : empty);
  }
}
