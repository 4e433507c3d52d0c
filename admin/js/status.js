// Live engine status: polls GET /admin/v1/status every few seconds, fills the cards and the
// per-tier counts, and feeds the tokens/s and TTFT chart.

import { api } from "./api.js";
import { $, fill, formatNumber, h } from "./dom.js";
import { ThroughputChart } from "./chart.js";

export const TIERS = ["device", "host", "disk", "store"];

// First present value among several dotted paths ("engine.num_running"), so the panel reads the
// status body whether counters are flat or grouped.
function pick(obj, ...paths) {
  for (const path of paths) {
    let cur = obj;
    for (const part of path.split(".")) {
      if (cur === null || cur === undefined || typeof cur !== "object") {
        cur = undefined;
        break;
      }
      cur = cur[part];
    }
    if (cur !== undefined && cur !== null) return cur;
  }
  return undefined;
}

/**
 * Read the fields the panel shows out of one status body: the server's summary fields at the
 * top level (cumulative counters, from which the panel derives rates), with the engine's own
 * stats under "engine" as a fallback.
 */
export function readStatus(body) {
  const kv = pick(body, "kv_cache_usage", "engine.kv_cache_usage");
  const tiers = pick(body, "adapters_per_tier", "engine.lora.tiers") || {};
  return {
    running: pick(body, "num_requests_running", "engine.num_requests_running"),
    waiting: pick(body, "num_requests_waiting", "engine.num_requests_waiting"),
    kvUsage: kv === undefined ? undefined : Number(kv),
    tiers: typeof tiers === "object" && !Array.isArray(tiers) ? tiers : {},
    loads: pick(body, "loads"),
    evictions: pick(body, "evictions"),
    generationTokens: pick(body, "generation_tokens_total", "engine.generation_tokens_total"),
    ttftSum: pick(body, "ttft_sum_seconds"),
    ttftCount: pick(body, "ttft_count"),
  };
}

/** The status panel; call start() after sign-in and stop() on sign-out. */
export class StatusPanel {
  constructor(root, { intervalMs = 2000 } = {}) {
    this.root = root;
    this.intervalMs = intervalMs;
    this.timer = null;
    this.previous = null; // last reading, for rates computed from cumulative counters
    this.chart = new ThroughputChart($("#status-chart", root), 300);
    this.updates = 0;
    this.lastTtftMs = null;
  }

  start() {
    this.stop();
    this.refresh();
    this.timer = setInterval(() => this.refresh(), this.intervalMs);
  }

  stop() {
    if (this.timer) clearInterval(this.timer);
    this.timer = null;
  }

  async refresh() {
    let body;
    try {
      body = await api("GET", "/status");
    } catch (err) {
      fill($("#status-error", this.root), `Status unavailable: ${err.message}`);
      return;
    }
    fill($("#status-error", this.root));
    const now = Date.now();
    const s = readStatus(body);
    const rates = this.rates(s, now);
    this.previous = { ...s, t: now };
    this.updates += 1;

    const set = (name, text) => fill($(`[data-stat="${name}"]`, this.root), text);
    set("running", formatNumber(s.running));
    set("waiting", formatNumber(s.waiting));
    set("kv", s.kvUsage === undefined ? "–" : `${formatNumber(kvPercent(s.kvUsage), 1)} %`);
    set("tps", rates.tps === null ? "–" : formatNumber(rates.tps, 1));
    // the card keeps the last measured TTFT; the chart shows gaps where none was measured
    if (rates.ttftMs !== null) this.lastTtftMs = rates.ttftMs;
    set("ttft", this.lastTtftMs === null ? "–" : `${formatNumber(this.lastTtftMs, 0)} ms`);
    set("loads", formatNumber(s.loads));
    set("evictions", formatNumber(s.evictions));
    const bar = $("#kv-bar", this.root);
    bar.value = s.kvUsage === undefined ? 0 : kvPercent(s.kvUsage);

    const tierRow = $("#tier-counts", this.root);
    fill(
      tierRow,
      TIERS.filter((tier) => tier in s.tiers).map((tier) =>
        h("div", { class: `tier-count tier-${tier}`, dataset: { tier } }, h("span", { class: "tier-name" }, tier), h("strong", {}, formatNumber(tierCount(s.tiers[tier]))))
      )
    );
    fill($("#status-updated", this.root), `updated ${new Date(now).toLocaleTimeString()}`);
    this.root.dataset.updates = String(this.updates);
    this.chart.add({ t: now, tps: rates.tps, ttftMs: rates.ttftMs });
  }

  // tokens/s and mean TTFT since the previous poll, from the change in cumulative counters.
  // No new first token in the interval leaves a gap in the TTFT line rather than a zero.
  rates(s, now) {
    const prev = this.previous;
    let tps = null;
    if (prev && s.generationTokens !== undefined && prev.generationTokens !== undefined) {
      const dt = (now - prev.t) / 1000;
      tps = dt > 0 ? Math.max(0, (s.generationTokens - prev.generationTokens) / dt) : null;
    }
    let ttftMs = null;
    if (prev && s.ttftCount !== undefined && prev.ttftCount !== undefined) {
      const dn = s.ttftCount - prev.ttftCount;
      ttftMs = dn > 0 ? ((s.ttftSum - prev.ttftSum) / dn) * 1000 : null;
    }
    return { tps, ttftMs };
  }
}

// The server may give KV usage as a fraction (vLLM's kv_cache_usage_perc is 0..1) or a percent.
function kvPercent(value) {
  return value <= 1 ? value * 100 : value;
}

function tierCount(value) {
  if (Array.isArray(value)) return value.length;
  if (value && typeof value === "object") return value.count ?? Object.keys(value).length;
  return value ?? 0;
}
