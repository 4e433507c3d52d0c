// Usage of the selected tenant (GET /admin/v1/tenants/{t}/usage): requests and tokens per adapter
// and day (or hour), with totals, for billing. The period is whole UTC hours or days, as the
// server keeps usage per UTC hour.

import { api, enc } from "./api.js";
import { $, fill, formatNumber, h } from "./dom.js";

// period value -> [hours back from the current hour's end, the time grouping]
const PERIODS = { "24h": [24, "hour"], "7d": [7 * 24, "day"], "30d": [30 * 24, "day"] };
const COUNTS = ["requests", "prompt_tokens", "completion_tokens", "total_tokens", "failed_requests"];

function hourIso(date) {
  return date.toISOString().replace(".000Z", "Z"); // on the hour: "2026-12-03T14:00:00Z"
}

/** The "Usage" view of the selected tenant. */
export class UsageView {
  constructor(root, { getTenant }) {
    this.root = root;
    this.getTenant = getTenant;
    $("#usage-period", root).addEventListener("change", () => this.load());
    $("#usage-refresh", root).addEventListener("click", () => this.load());
  }

  async load() {
    const tenant = this.getTenant();
    fill($("#usage-tenant", this.root), tenant || "no tenant");
    if (!tenant) {
      fill($("#usage-rows", this.root));
      fill($("#usage-totals", this.root));
      return;
    }
    const [hours, unit] = PERIODS[$("#usage-period", this.root).value] || PERIODS["7d"];
    const end = new Date();
    end.setUTCMinutes(0, 0, 0);
    end.setUTCHours(end.getUTCHours() + 1); // through the current hour
    const start = new Date(end.getTime() - hours * 3600 * 1000);
    const query = `?start=${enc(hourIso(start))}&end=${enc(hourIso(end))}&group_by=${unit},adapter`;
    let body;
    try {
      body = await api("GET", `/tenants/${enc(tenant)}/usage${query}`);
    } catch (err) {
      fill($("#usage-error", this.root), err.message);
      return;
    }
    fill($("#usage-error", this.root));
    fill($("#usage-when", this.root), unit === "hour" ? "Hour (UTC)" : "Day (UTC)"); // with the rows it heads
    const cells = (row) => COUNTS.map((c) => h("td", { class: "num", dataset: { count: c } }, formatNumber(row[c] ?? 0)));
    const rows = (body.data || []).map((row) =>
      h(
        "tr",
        { dataset: { adapter: row.adapter ?? "", when: row[unit] } },
        h("td", { class: "nowrap" }, unit === "hour" ? row.hour.replace("T", " ").replace(":00:00Z", ":00") : row.day),
        h("td", {}, row.adapter ?? h("span", { class: "muted" }, "base model")),
        ...cells(row)
      )
    );
    const empty = h("tr", {}, h("td", { colspan: 2 + COUNTS.length, class: "empty" }, "No usage in this period."));
    fill($("#usage-rows", this.root), rows.length ? rows : empty);
    fill($("#usage-totals", this.root), h("tr", {}, h("th", { colspan: 2 }, "Total"), ...cells(body.totals || {})));
  }
}
