// Upload a new adapter version: a PEFT directory's two files (adapter_config.json,
// adapter_model.safetensors), or one archive (.tar.gz / .zip) of the directory. Files come from
// drag-and-drop (files or a whole folder) or the file picker. The server validates; when it
// refuses, its message is shown as it wrote it.

import { enc, uploadForm } from "./api.js";
import { $, fill, formatBytes, h, toast } from "./dom.js";

const ARCHIVE = /\.(tar\.gz|tgz|tar|zip)$/i;
// From a dropped folder only the adapter's own files are sent (not a README or checkpoints).
const ADAPTER_FILE = /^adapter_(config\.json|model\.[a-z0-9]+)$/i;

/** Which multipart field each file goes in: one archive -> "archive", else the file's own name. */
export function planUpload(files) {
  const archives = files.filter((f) => ARCHIVE.test(f.name));
  if (archives.length && files.length > 1) {
    return { error: "Send either one archive or the directory's files, not both." };
  }
  if (archives.length) return { fields: [["archive", archives[0]]] };
  if (!files.length) return { error: "Choose adapter_config.json and adapter_model.safetensors, or one archive." };
  return { fields: files.map((f) => [f.name, f]) };
}

// A dropped folder arrives as a directory entry; read its files (one level, as PEFT writes them).
function readDirectory(entry) {
  return new Promise((resolve) => {
    const reader = entry.createReader();
    const out = [];
    const next = () =>
      reader.readEntries(async (entries) => {
        if (!entries.length) return resolve(out);
        for (const e of entries) {
          if (!e.isFile || !ADAPTER_FILE.test(e.name)) continue;
          try {
            out.push(await new Promise((res, rej) => e.file(res, rej)));
          } catch (_) {
            // an unreadable file is left out; the server then names what is missing
          }
        }
        next();
      }, () => resolve(out));
    next();
  });
}

/** The upload card inside the Adapters view. */
export class UploadPanel {
  constructor(root, { getTenant, onUploaded }) {
    this.root = root;
    this.getTenant = getTenant;
    this.onUploaded = onUploaded;
    this.files = [];
    this.busy = false;
    const zone = $("#drop-zone", root);
    const input = $("#upload-files", root);
    input.addEventListener("change", () => this.setFiles([...input.files]));
    zone.addEventListener("click", (ev) => {
      if (ev.target === zone || ev.target.classList.contains("drop-hint")) input.click();
    });
    zone.addEventListener("keydown", (ev) => {
      if (ev.key === "Enter" || ev.key === " ") {
        ev.preventDefault();
        input.click();
      }
    });
    zone.addEventListener("dragover", (ev) => {
      ev.preventDefault();
      zone.classList.add("dragging");
    });
    zone.addEventListener("dragleave", () => zone.classList.remove("dragging"));
    zone.addEventListener("drop", (ev) => this.onDrop(ev));
    $("#upload-form", root).addEventListener("submit", (ev) => {
      ev.preventDefault();
      this.submit();
    });
  }

  /** Prefill the name (the "upload new version" button of an adapter row). */
  prepare(name) {
    $("#upload-name", this.root).value = name;
    $("#upload-name", this.root).focus();
  }

  async onDrop(ev) {
    ev.preventDefault();
    $("#drop-zone", this.root).classList.remove("dragging");
    // The drop's items are readable only while this handler runs synchronously: take every entry
    // and file first, then read folders.
    const items = [...(ev.dataTransfer.items || [])];
    const files = [];
    const folders = [];
    for (const item of items) {
      const entry = item.webkitGetAsEntry ? item.webkitGetAsEntry() : null;
      if (entry && entry.isDirectory) {
        folders.push(entry);
      } else {
        const file = item.getAsFile();
        if (file) files.push(file);
      }
    }
    if (!items.length) files.push(...ev.dataTransfer.files);
    let folderName = null;
    for (const entry of folders) {
      folderName = entry.name;
      files.push(...(await readDirectory(entry)));
    }
    const nameInput = $("#upload-name", this.root);
    if (folderName && !nameInput.value) nameInput.value = folderName.toLowerCase().replace(/[^a-z0-9_-]/g, "-");
    this.setFiles(files);
  }

  setFiles(files) {
    this.files = files;
    const list = files.map((f) => h("li", {}, h("span", { class: "mono" }, f.name), ` (${formatBytes(f.size)})`));
    fill($("#upload-file-list", this.root), list);
    fill($("#upload-message", this.root));
    this.setProgress(0, "");
  }

  setProgress(fraction, label) {
    const bar = $("#upload-progress", this.root);
    bar.value = Math.round(fraction * 100);
    bar.hidden = !label;
    fill($("#upload-progress-label", this.root), label);
  }

  showMessage(text, kind) {
    const box = $("#upload-message", this.root);
    box.className = `message ${kind}`;
    box.setAttribute("role", kind === "error" ? "alert" : "status");
    fill(box, text);
  }

  async submit() {
    if (this.busy) return;
    const tenant = this.getTenant();
    const name = $("#upload-name", this.root).value.trim();
    if (!tenant) return this.showMessage("Select a tenant first.", "error");
    if (!name) return this.showMessage("Give the adapter a name.", "error");
    const plan = planUpload(this.files);
    if (plan.error) return this.showMessage(plan.error, "error");

    this.busy = true;
    $("#upload-submit", this.root).disabled = true;
    this.root.dataset.uploadState = "uploading";
    this.setProgress(0, "Uploading…");
    try {
      const version = await uploadForm(
        `/tenants/${enc(tenant)}/adapters/${enc(name)}/versions`,
        plan.fields,
        (loaded, total) => this.setProgress(loaded / total, `Uploading… ${formatBytes(loaded)} of ${formatBytes(total)}`)
      );
      this.setProgress(1, "Uploaded.");
      const v = version && (version.version ?? version.number);
      const again = version && version.created === false ? " (identical to an existing version)" : "";
      this.showMessage(`Uploaded ${name} v${v ?? "?"}${again}.`, "ok");
      toast(`Uploaded ${name} v${v ?? "?"}.`);
      this.root.dataset.uploadState = "done";
      this.files = [];
      $("#upload-files", this.root).value = "";
      fill($("#upload-file-list", this.root));
      await this.onUploaded(name);
    } catch (err) {
      this.setProgress(0, "");
      this.showMessage(`Upload refused (${err.status || "network"}): ${err.message}`, "error");
      this.root.dataset.uploadState = "error";
    } finally {
      this.busy = false;
      $("#upload-submit", this.root).disabled = false;
    }
  }
}
