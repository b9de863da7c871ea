// The npm e2b SDK builds templates on the real service (real VMs) and runs sandboxes from
// them; prints one JSON line for tests/e2e/test_templates.py. argv: COPY context dir, image.
import { Template, Sandbox, waitForPort } from "e2b";

const [context, image] = process.argv.slice(2);
const out = {};
try {
  const site = Template({ fileContextPath: context })
    .fromTemplate("base")
    .runCmd("mkdir -p /app && chown user:user /app", { user: "root" })
    .copy("site/index.html", "/app/")
    .setEnvs({ GREETING: "hi from js" })
    .setWorkdir("/app")
    .setUser("user")
    .runCmd("echo $GREETING > greeting.txt")
    // `exec -a` is a bash builtin: E2B runs a start command through `bash -l -c`
    .setStartCmd("(exec -a js-start-marker sleep infinity) & python3 -m http.server 8000",
      waitForPort(8000));
  const logs = [];
  await Template.build(site, "e2e-js-site", { onBuildLogs: (e) => logs.push(e.message) });
  out.logs = logs;
  let sbx = await Sandbox.create("e2e-js-site");
  out.run = (await sbx.commands.run("pwd; cat greeting.txt; echo $GREETING; whoami")).stdout;
  out.processes = (await sbx.commands.run("cat /proc/[0-9]*/cmdline 2>/dev/null | tr '\\0' ' '")).stdout;
  out.host = sbx.getHost(8000);
  out.sandboxId = sbx.sandboxId;

  try {
    await Template.build(Template().fromTemplate("base").runCmd("whoami", { user: "root123" }),
      "e2e-js-nouser");
    out.noUser = "built";
  } catch (e) {
    out.noUser = e.message;
  }

  const bb = Template().fromImage(image).runCmd("echo from-js > /srv/js.txt")
    .setStartCmd("httpd -f -p 8080 -h /srv", "pidof httpd"); // no pgrep in busybox
  await Template.build(bb, "e2e-js-busybox");
  const sbx2 = await Sandbox.create("e2e-js-busybox");
  out.busybox = (await sbx2.commands.run("cat /srv/js.txt; busybox | head -1")).stdout;
  out.busyboxHost = sbx2.getHost(8080);
  out.busyboxId = sbx2.sandboxId;
} catch (e) {
  out.error = `${e.name}: ${e.message}`;
  console.log(JSON.stringify(out));
  process.exit(1);
}
console.log(JSON.stringify(out));
