// The MCP door driven by the official TypeScript SDK client (tests/mcp/test_ts_client.py).
//
//   node client.mjs <url> <spawn-arguments-json> [await-timeout-seconds]
//
// Connects over streamable HTTP, lists the tools, calls `spawn` with the given arguments,
// then `await` on the handle it returned, and prints one JSON object on stdout:
//   { protocolVersion, sessionId, sessionTerminated, server, tools, outputSchemas, spawn,
//     await, textMatches, timingsMs }
// `spawn` and `await` are the tools' structuredContent (validated by the SDK against the
// tools' output schemas). Any error: the message on stderr and exit status 1.

import { Client } from "@modelcontextprotocol/sdk/client/index.js";
import { StreamableHTTPClientTransport } from "@modelcontextprotocol/sdk/client/streamableHttp.js";

function usage(message) {
  throw new Error(`${message}\nusage: node client.mjs <url> <spawn-arguments-json> [await-timeout-seconds]`);
}

// A tool result's structuredContent; a tool error (isError) is an error here.
function structured(name, result) {
  const text = (result.content ?? [])
    .filter((c) => c.type === "text")
    .map((c) => c.text)
    .join(" ");
  if (result.isError) throw new Error(`${name} failed: ${text || JSON.stringify(result)}`);
  if (result.structuredContent === undefined) {
    throw new Error(`${name} returned no structuredContent: ${JSON.stringify(result)}`);
  }
  // The spec asks servers to mirror structured content as serialized JSON in a text block.
  let textMatches = false;
  try {
    textMatches = JSON.stringify(JSON.parse(text)) === JSON.stringify(result.structuredContent);
  } catch {
    textMatches = false;
  }
  return { content: result.structuredContent, textMatches };
}

async function main(argv) {
  const [url, spawnJson, awaitTimeoutArg] = argv;
  if (!url) usage("missing <url>");
  if (!spawnJson) usage("missing <spawn-arguments-json>");
  let spawnArgs;
  try {
    spawnArgs = JSON.parse(spawnJson);
  } catch (err) {
    usage(`<spawn-arguments-json> is not JSON: ${err.message}`);
  }
  if (typeof spawnArgs !== "object" || spawnArgs === null || Array.isArray(spawnArgs)) {
    usage("<spawn-arguments-json> must be a JSON object");
  }
  const awaitTimeout = awaitTimeoutArg === undefined ? 60 : Number(awaitTimeoutArg);
  if (!(awaitTimeout > 0)) usage(`bad await timeout ${awaitTimeoutArg}`);

  const timings = {};
  const timed = async (what, fn) => {
    const started = performance.now();
    try {
      return await fn();
    } finally {
      timings[what] = Math.round((performance.now() - started) * 10) / 10;
    }
  };

  const client = new Client({ name: "luftpause-ts-test", version: "0.0.0" });
  const transport = new StreamableHTTPClientTransport(new URL(url));
  await timed("connect", () => client.connect(transport));
  try {
    const listed = await timed("listTools", () => client.listTools());
    const tools = listed.tools.map((t) => t.name);
    const outputSchemas = Object.fromEntries(
      listed.tools.map((t) => [t.name, t.outputSchema ?? null]),
    );

    const spawned = structured(
      "spawn",
      await timed("spawn", () => client.callTool({ name: "spawn", arguments: spawnArgs })),
    );
    const handle = spawned.content.handle;
    if (typeof handle !== "string" || !handle) {
      throw new Error(`spawn returned no handle: ${JSON.stringify(spawned.content)}`);
    }
    // The SDK's own request timeout (60 s by default) must outlast the server-side wait.
    const awaited = structured(
      "await",
      await timed("await", () =>
        client.callTool(
          { name: "await", arguments: { handles: [handle], timeout: awaitTimeout } },
          undefined,
          { timeout: (awaitTimeout + 30) * 1000 },
        ),
      ),
    );

    const sessionId = transport.sessionId ?? null;
    // End the session on the server (DELETE /mcp with the session id); a failure is an error.
    await timed("terminateSession", () => transport.terminateSession());
    const report = {
      protocolVersion: transport.protocolVersion ?? null,
      sessionId,
      sessionTerminated: transport.sessionId === undefined,
      server: client.getServerVersion() ?? null,
      tools,
      outputSchemas,
      spawn: spawned.content,
      await: awaited.content,
      textMatches: { spawn: spawned.textMatches, await: awaited.textMatches },
      timingsMs: timings,
    };
    process.stdout.write(`${JSON.stringify(report)}\n`);
  } finally {
    await client.close();
  }
}

try {
  await main(process.argv.slice(2));
} catch (err) {
  // fetch errors keep the reason (ECONNREFUSED, ...) in `cause`.
  const cause = err?.cause ? ` (cause: ${err.cause.message ?? err.cause})` : "";
  process.stderr.write(`client.mjs: ${err?.message ?? err}${cause}\n${err?.stack ?? ""}\n`);
  process.exitCode = 1;
}
