// A Node.js client of Tandem's public API, loading the .proto at run time.
//
//   node client.js HOST:PORT [PROTO_ROOT]
//
// It streams one generation, cancels a second one mid-stream, and reads the status of
// an invalid request, then prints one JSON object describing what it saw on stdout.
// PROTO_ROOT is the folder that holds tandem/generate/v1/generate.proto (default: the
// repository's protos/). Set TANDEM_API_KEY to send "authorization: Bearer KEY".
"use strict";

const path = require("path");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");

const CALL_DEADLINE_MS = 60_000;

function loadService(protoRoot) {
  const definition = protoLoader.loadSync("tandem/generate/v1/generate.proto", {
    includeDirs: [protoRoot],
    keepCase: true, // field names as in the .proto: sampling_params, max_tokens ...
    longs: String,
    enums: String, // finish_reason: "FINISH_REASON_LENGTH"
    defaults: true,
    oneofs: true, // which member of a oneof is set: response.matched_stop
  });
  return grpc.loadPackageDefinition(definition).tandem.generate.v1.GenerateService;
}

function deadline() {
  return new Date(Date.now() + CALL_DEADLINE_MS);
}

function metadata() {
  const md = new grpc.Metadata();
  if (process.env.TANDEM_API_KEY) md.set("authorization", `Bearer ${process.env.TANDEM_API_KEY}`);
  return md;
}

function unary(client, method, request) {
  return new Promise((resolve, reject) => {
    client[method](request, metadata(), { deadline: deadline() }, (err, response) =>
      err ? reject(err) : resolve(response),
    );
  });
}

function statusOf(err) {
  return { code: err.code, code_name: grpc.status[err.code], details: err.details };
}

// Reads a whole Generate stream; resolves with its responses and final status.
function streamGeneration(client, request) {
  return new Promise((resolve) => {
    const responses = [];
    const call = client.Generate(request, metadata(), { deadline: deadline() });
    call.on("data", (response) => responses.push(response));
    call.on("error", (err) => resolve({ responses, status: statusOf(err) }));
    call.on("status", (status) => {
      if (status.code === grpc.status.OK) resolve({ responses, status: { code: 0, code_name: "OK", details: "" } });
    });
  });
}

// Starts a long generation and cancels the call after `after` responses.
function cancelMidStream(client, request, after) {
  return new Promise((resolve) => {
    let received = 0;
    const call = client.Generate(request, metadata(), { deadline: deadline() });
    call.on("data", () => {
      received += 1;
      if (received === after) call.cancel();
    });
    call.on("error", (err) => resolve({ received, status: statusOf(err) }));
    call.on("status", (status) => {
      if (status.code === grpc.status.OK) resolve({ received, status: { code: 0, code_name: "OK", details: "" } });
    });
  });
}

function summary(run) {
  const last = run.responses[run.responses.length - 1] || {};
  return {
    status: run.status,
    num_responses: run.responses.length,
    text: run.responses.map((r) => r.text).join(""),
    token_ids: run.responses.flatMap((r) => r.token_ids),
    finish_reason: last.finish_reason || null,
    matched_stop: last.matched_stop || null,
    stop_str: last.stop_str || null,
    usage: last.usage || null,
  };
}

async function main() {
  const [address, protoRoot = path.resolve(__dirname, "..", "..", "..", "protos")] = process.argv.slice(2);
  if (!address) throw new Error("usage: node client.js HOST:PORT [PROTO_ROOT]");
  const GenerateService = loadService(protoRoot);
  const client = new GenerateService(address, grpc.credentials.createInsecure());
  const greedy = { temperature: 0, ignore_eos: true };

  const info = await unary(client, "GetModelInfo", {});
  const tokenized = await unary(client, "Tokenize", { text: "Hello from Node" });

  const streamed = await streamGeneration(client, {
    text: "Once upon a time",
    return_token_ids: true,
    sampling_params: { max_tokens: 8, ...greedy },
  });
  const detokenized = await unary(client, "Detokenize", { token_ids: summary(streamed).token_ids });

  const cancelled = await cancelMidStream(
    client,
    { text: "Once upon a time", sampling_params: { max_tokens: 1500, ...greedy } },
    3,
  );

  const invalid = await streamGeneration(client, { text: "hi", sampling_params: { top_p: 2 } });
  let unaryError = null;
  try {
    await unary(client, "Detokenize", { token_ids: [1, 10_000_000] });
  } catch (err) {
    unaryError = statusOf(err);
  }

  client.close();
  process.stdout.write(
    JSON.stringify({
      model_info: { model_name: info.model_name, max_model_len: info.max_model_len, vocab_size: info.vocab_size },
      tokenize: { token_ids: tokenized.token_ids, tokens: tokenized.tokens },
      stream: { ...summary(streamed), detokenized: detokenized.text },
      cancel: cancelled,
      invalid: { num_responses: invalid.responses.length, status: invalid.status },
      unary_error: unaryError,
    }) + "\n",
  );
}

main().catch((err) => {
  process.stderr.write(`${err.stack || err}\n`);
  process.exit(1);
});
