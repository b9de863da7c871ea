// Issue 14 item 9 with the npm e2b SDK against the real service: a background command
// whose sandbox is killed ends as on E2B (the connection terminated), and the SDK's
// health probe turns that into its "killed or reached its end of life" TimeoutError.
// Prints one JSON line; any failed assertion exits non-zero.
import assert from 'node:assert/strict'
import { Sandbox, TimeoutError } from 'e2b'

const sbx = await Sandbox.create({ timeoutMs: 300_000 })
const handle = await sbx.commands.run('sleep 1000', { background: true, timeoutMs: 0 })
const waiting = handle.wait().then(() => null, (e) => e)
await new Promise((r) => setTimeout(r, 500))
assert.equal(await Sandbox.kill(sbx.sandboxId), true)
const err = await waiting
assert.ok(err instanceof TimeoutError, `got ${err && err.constructor.name}: ${err}`)
assert.match(err.message, /killed or reached its end of life/)
console.log(JSON.stringify({ error: err.constructor.name, message: err.message }))
