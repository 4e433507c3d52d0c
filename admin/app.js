// loraplex admin UI: wires sign-in, the tenant selector, the views and the live status poll.
// Plain ES modules, no build step, nothing fetched from outside this server.

import { api, clearAdminKey, getAdminKey, setAdminKey, setUnauthorizedHandler } from "./js/api.js";
import { $, fill, h } from "./js/dom.js";
import { StatusPanel } from "./js/status.js";
import { TenantsView } from "./js/tenants.js";
import { AdaptersView } from "./js/adapters.js";
import { UploadPanel } from "./js/upload.js";
import { AuditView } from "./js/audit.js";
import { UsageView } from "./js/usage.js";

const TENANT_STORAGE = "loraplex.tenant";
const VIEWS = ["overview", "tenants", "adapters", "usage", "audit"];

/** One page: sign-in screen, then the console with its five views. */
class AdminApp {
  constructor() {
    this.tenant = sessionStorage.getItem(TENANT_STORAGE) || "";
    const getTenant = () => this.tenant;
    const setTenant = (name) => this.selectTenant(name);
    this.status = new StatusPanel($("#view-overview"), { intervalMs: 2000 });
    this.tenants = new TenantsView($("#view-tenants"), {
      getTenant,
      setTenant,
      onTenantsChanged: (names) => this.fillTenantSelect(names),
    });
    this.upload = new UploadPanel($("#upload-card"), {
      getTenant,
      onUploaded: async () => {
        await this.adapters.load();
        await this.audit.load();
      },
    });
    this.adapters = new AdaptersView($("#view-adapters"), {
      getTenant,
      onUploadVersion: (name) => this.upload.prepare(name),
      onChanged: () => this.audit.load(),
    });
    this.audit = new AuditView($("#view-audit"), { getTenant });
    this.usage = new UsageView($("#view-usage"), { getTenant });

    setUnauthorizedHandler(() => this.signOut("The admin key was refused; sign in again."));
    $("#signin-form").addEventListener("submit", (ev) => {
      ev.preventDefault();
      this.signIn($("#signin-key").value.trim());
    });
    $("#signout").addEventListener("click", () => this.signOut());
    $("#tenant-select").addEventListener("change", (ev) => this.selectTenant(ev.target.value));
    for (const view of VIEWS) {
      $(`#nav-${view}`).addEventListener("click", (ev) => {
        ev.preventDefault();
        this.show(view);
      });
    }
    window.addEventListener("hashchange", () => this.show(this.viewFromHash(), false));
  }

  async start() {
    if (getAdminKey()) await this.enter();
    else this.showSignIn();
  }

  showSignIn(message = "") {
    document.body.dataset.signedIn = "false";
    $("#signin").hidden = false;
    $("#console").hidden = true;
    fill($("#signin-error"), message);
    $("#signin-key").focus();
  }

  async signIn(key) {
    if (!key) return;
    // Check the key before keeping it: any admin route answers 401 to a wrong key.
    try {
      await api("GET", "/tenants", undefined, { key });
    } catch (err) {
      fill($("#signin-error"), err.status === 401 ? "That admin key was refused." : `Cannot reach the server: ${err.message}`);
      return;
    }
    setAdminKey(key);
    $("#signin-key").value = "";
    await this.enter();
  }

  signOut(message = "") {
    clearAdminKey();
    this.status.stop();
    this.tenants.hideSecret();
    this.showSignIn(message);
  }

  async enter() {
    document.body.dataset.signedIn = "true";
    $("#signin").hidden = true;
    $("#console").hidden = false;
    this.show(this.viewFromHash(), false);
    this.status.start();
    await this.tenants.load();
    await Promise.all([this.adapters.load(), this.audit.load()]);
  }

  viewFromHash() {
    const name = location.hash.replace(/^#\/?/, "");
    return VIEWS.includes(name) ? name : "overview";
  }

  show(view, pushHash = true) {
    for (const name of VIEWS) {
      $(`#view-${name}`).hidden = name !== view;
      $(`#nav-${name}`).classList.toggle("current", name === view);
      $(`#nav-${name}`).setAttribute("aria-current", name === view ? "page" : "false");
    }
    if (pushHash && location.hash !== `#/${view}`) history.replaceState(null, "", `#/${view}`);
    if (view === "audit" && getAdminKey()) this.audit.load();
    if (view === "adapters" && getAdminKey()) this.adapters.load();
    if (view === "usage" && getAdminKey()) this.usage.load();
  }

  fillTenantSelect(names) {
    if (!names.includes(this.tenant)) this.tenant = names[0] || "";
    sessionStorage.setItem(TENANT_STORAGE, this.tenant);
    const select = $("#tenant-select");
    fill(
      select,
      names.length ? names.map((n) => h("option", { value: n, selected: n === this.tenant }, n)) : h("option", { value: "" }, "no tenants")
    );
    select.value = this.tenant;
  }

  async selectTenant(name) {
    if (name === this.tenant && $("#tenant-select").value === name) return;
    this.tenant = name;
    sessionStorage.setItem(TENANT_STORAGE, name);
    $("#tenant-select").value = name;
    this.tenants.renderTenants();
    await Promise.all([this.tenants.loadKeys(), this.adapters.load(), this.audit.load(), this.usage.load()]);
  }
}

new AdminApp().start();
