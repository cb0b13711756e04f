// A kvhandoff Router client that knows only the .proto files: it loads
// proto/kvhandoff/v1/router.proto at run time with @grpc/proto-loader and calls the
// router with @grpc/grpc-js (a gRPC implementation independent of the Python stubs).
//
//   node client.js ROUTER_ADDRESS REQUEST_JSON
//   node client.js ROUTER_ADDRESS PARENT_REQUEST_JSON CONTINUE_REQUEST_JSON
//
// With one request, REQUEST_JSON is a kvhandoff.v1.GenerateRequest in proto3 JSON-ish
// field names (snake_case). Prints {"unary": GenerateResponse, "stream": {"stage1_ids":
// [...], "result": GenerateResponse}} as JSON. With two, the two-call flow: StartParent
// (a ParentRequest; its stage-1 tokens streamed), then Continue (a ContinueRequest whose
// parent_id is filled in with the Parent's). Prints {"stage1_ids": [...], "parent":
// Parent, "continuation": GenerateResponse}. On an RPC error prints {"code", "details"}
// and exits 3.
"use strict";

const path = require("path");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");

const PROTO_ROOT = path.resolve(__dirname, "..", "..", "proto");

function loadRouter() {
  const def = protoLoader.loadSync("kvhandoff/v1/router.proto", {
    includeDirs: [PROTO_ROOT],
    keepCase: true,
    longs: Number,
    enums: String,
    defaults: true,
    oneofs: true,
  });
  return grpc.loadPackageDefinition(def).kvhandoff.v1.Router;
}

function unary(client, request, deadline) {
  return new Promise((resolve, reject) => {
    client.Generate(request, { deadline }, (err, resp) => (err ? reject(err) : resolve(resp)));
  });
}

function stream(client, request, deadline) {
  return new Promise((resolve, reject) => {
    const ids = [];
    let result = null;
    const call = client.GenerateStream(request, { deadline });
    call.on("data", (event) => {
      if (event.event === "stage1_tokens") ids.push(...event.stage1_tokens.ids);
      else result = event.result;
    });
    call.on("error", reject);
    call.on("end", () => resolve({ stage1_ids: ids, result }));
  });
}

function startParent(client, request, deadline) {
  return new Promise((resolve, reject) => {
    const ids = [];
    let parent = null;
    const call = client.StartParent(request, { deadline });
    call.on("data", (event) => {
      if (event.event === "stage1_tokens") ids.push(...event.stage1_tokens.ids);
      else parent = event.parent;
    });
    call.on("error", reject);
    call.on("end", () => resolve({ stage1_ids: ids, parent }));
  });
}

function continueParent(client, request, deadline) {
  return new Promise((resolve, reject) => {
    client.Continue(request, { deadline }, (err, resp) => (err ? reject(err) : resolve(resp)));
  });
}

async function twoCalls(client, parentRequest, continueRequest, deadline) {
  const { stage1_ids, parent } = await startParent(client, parentRequest, deadline());
  const continuation = await continueParent(
    client, { ...continueRequest, parent_id: parent.parent_id }, deadline());
  return { stage1_ids, parent, continuation };
}

async function main() {
  const [address, requestJson, continueJson] = process.argv.slice(2);
  const Router = loadRouter();
  const client = new Router(address, grpc.credentials.createInsecure());
  const request = JSON.parse(requestJson);
  const deadline = () => Date.now() + 120000;
  try {
    const out = continueJson
      ? await twoCalls(client, request, JSON.parse(continueJson), deadline)
      : {
          unary: await unary(client, request, deadline()),
          stream: await stream(client, request, deadline()),
        };
    process.stdout.write(JSON.stringify(out) + "\n");
  } catch (err) {
    process.stdout.write(JSON.stringify({ code: err.code, details: err.details }) + "\n");
    process.exitCode = 3;
  } finally {
    client.close();
  }
}

main();
