// Issue 14 item 10 with the npm e2b SDK against the real service: a background command
// started before pause() keeps running after connect() (the VM's processes are frozen and
// thawed, not killed). Prints one JSON line; any failed assertion exits non-zero.
import assert from 'node:assert/strict'
import { Sandbox } from 'e2b'

const sbx = await Sandbox.create({ timeoutMs: 300_000 })
try {
  await sbx.commands.run('sleep 2 && echo done > /home/user/f', { background: true, timeoutMs: 0 })
  assert.equal(await sbx.pause(), true)
  const again = await Sandbox.connect(sbx.sandboxId, { timeoutMs: 300_000 })
  await new Promise((r) => setTimeout(r, 4000))
  const content = await again.files.read('/home/user/f')
  assert.equal(content, 'done\n')
  console.log(JSON.stringify({ content }))
} finally {
  await Sandbox.kill(sbx.sandboxId)
}
