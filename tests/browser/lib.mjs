// Shared by the browser tests: a static server on 127.0.0.1 and Debian's Chromium with WebGPU
// (SwiftShader on a machine without a GPU). Never downloads a browser.
import { spawn } from "node:child_process";
import { chromium } from "playwright-core";
import { fileURLToPath } from "node:url";
import path from "node:path";
import fs from "node:fs";

export const root = path.resolve(path.dirname(fileURLToPath(import.meta.url)), "../..");
export const golden = JSON.parse(fs.readFileSync(path.join(process.env.GOLDEN_DIR ?? path.join(root, "../shared/golden"), "generations.json"), "utf8"));
export const modelPath = path.join(root, "models/SmolLM2-135M-Instruct.Q4_1.gguf");
export const artifacts = path.join(root, "target/browser-tests");
fs.mkdirSync(artifacts, { recursive: true });

/** Serves `dir` on an ephemeral port; resolves to {url, close}. */
export function serve(dir) {
  return new Promise((resolve, reject) => {
    const proc = spawn("python3", ["-u", "-m", "http.server", "0", "--bind", "127.0.0.1", "--directory", dir], { stdio: ["ignore", "pipe", "pipe"] });
    let out = "";
    proc.stdout.on("data", (d) => {
      out += d;
      const m = out.match(/port (\d+)/);
      if (m) resolve({ url: `http://127.0.0.1:${m[1]}`, close: () => proc.kill() });
    });
    proc.stderr.on("data", () => {});
    proc.on("exit", (code) => reject(new Error(`static server exited with ${code}: ${out}`)));
  });
}

/** Headless Chromium; `webgpu: false` leaves WebGPU off, as on a browser without a usable GPU. */
export async function launch({ webgpu = true } = {}) {
  return chromium.launch({
    executablePath: process.env.CHROMIUM ?? "/usr/bin/chromium",
    args: [
      "--no-sandbox",
      ...(webgpu ? ["--enable-unsafe-webgpu"] : []),
      "--disable-background-networking",
      "--disable-component-update",
      "--disable-sync",
      "--no-first-run",
      "--disable-dev-shm-usage",
    ],
  });
}

/** A folder to serve, with links to the built package and the default model. */
export function stage(name, files) {
  const dir = path.join(artifacts, name);
  fs.rmSync(dir, { recursive: true, force: true });
  fs.mkdirSync(dir, { recursive: true });
  fs.symlinkSync(path.join(root, "pkg"), path.join(dir, "pkg"));
  fs.symlinkSync(modelPath, path.join(dir, "model.gguf"));
  for (const [file, text] of Object.entries(files)) fs.writeFileSync(path.join(dir, file), text);
  return dir;
}
