#!/usr/bin/env node
// A Node.js client of pdq's public API (pdq.v1.Generation): Generate, GenerateStream and
// Cancel. It loads protos/pdq/v1/generation.proto at run time, so nothing is generated.
//
//   PDQ_API_KEY=<key> node client.js ["prompt"]
//
// Environment:
//   PDQ_TARGET      gateway address (default 127.0.0.1:50051)
//   PDQ_API_KEY     API key, sent as `authorization: Bearer <key>`
//   PDQ_TLS_CA      PEM file of the CA to trust for a TLS gateway (unset = plaintext)
//   PDQ_PROTOS      include dir of the protos (default ../../protos next to this file)
//   PDQ_MAX_TOKENS  tokens to generate in the Generate and GenerateStream steps (default 16)
'use strict';

const fs = require('fs');
const path = require('path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

const TARGET = process.env.PDQ_TARGET || '127.0.0.1:50051';
const API_KEY = process.env.PDQ_API_KEY || '';
const PROTOS = process.env.PDQ_PROTOS || path.resolve(__dirname, '..', '..', 'protos');
const MAX_TOKENS = Number(process.env.PDQ_MAX_TOKENS || 16);
const CALL_TIMEOUT_MS = 120000;

function loadGeneration() {
  const definition = protoLoader.loadSync('pdq/v1/generation.proto', {
    includeDirs: [PROTOS],
    keepCase: true, // field names as in the .proto: request_id, finish_reason, ...
    longs: String, // uint64 seed
    enums: String, // finish_reason as 'FINISH_REASON_LENGTH'
    defaults: true,
    oneofs: true, // proto3 `optional index` stays unset when absent
  });
  return grpc.loadPackageDefinition(definition).pdq.v1.Generation;
}

function credentials() {
  if (process.env.PDQ_TLS_CA) {
    return grpc.credentials.createSsl(fs.readFileSync(process.env.PDQ_TLS_CA));
  }
  return grpc.credentials.createInsecure();
}

function metadata() {
  const md = new grpc.Metadata();
  if (API_KEY) md.set('authorization', `Bearer ${API_KEY}`);
  return md;
}

function options() {
  return { deadline: new Date(Date.now() + CALL_TIMEOUT_MS) };
}

function statusName(code) {
  return Object.keys(grpc.status).find((name) => grpc.status[name] === code) || String(code);
}

function generate(client, request) {
  return new Promise((resolve, reject) => {
    client.Generate(request, metadata(), options(), (err, response) => (err ? reject(err) : resolve(response)));
  });
}

function cancel(client, requestId) {
  return new Promise((resolve, reject) => {
    client.Cancel({ request_id: requestId }, metadata(), options(), (err, response) => (err ? reject(err) : resolve(response)));
  });
}

// Streams a request; onMessage(msg, call) sees every message. Resolves with the call's
// final status ({code, details}), whether OK or an error.
function stream(client, request, onMessage) {
  return new Promise((resolve) => {
    const call = client.GenerateStream(request, metadata(), options());
    call.on('data', (msg) => onMessage(msg, call));
    call.on('error', (err) => resolve({ code: err.code, details: err.details }));
    call.on('status', (status) => {
      if (status.code === grpc.status.OK) resolve({ code: status.code, details: status.details });
    });
  });
}

function request(prompt, maxTokens) {
  return { prompt, sampling: { max_tokens: maxTokens, temperature: 0, ignore_eos: true } };
}

async function main() {
  const prompt = process.argv[2] || 'Hello from Node.js';
  const Generation = loadGeneration();
  const client = new Generation(TARGET, credentials());
  console.log(`target ${TARGET}`);

  // 1. Generate: the whole completion at once.
  console.log('== Generate');
  const r = await generate(client, request(prompt, MAX_TOKENS));
  console.log(`request_id ${r.request_id}`);
  console.log(`text ${JSON.stringify(r.text)}`);
  console.log(`finish_reason ${r.finish_reason} prompt_tokens ${r.usage.prompt_tokens} ` +
              `completion_tokens ${r.usage.completion_tokens} ttft_ms ${r.timings.ttft_ms.toFixed(1)}`);

  // 2. GenerateStream: a message per token as it comes (the tokens already there in one
  //    message, when the stream is read behind them), printed a token a line.
  console.log('== GenerateStream');
  const end = await stream(client, request(prompt, MAX_TOKENS), (msg) => {
    if (msg.index !== undefined && msg.index !== null) {
      msg.token_ids.forEach((t, k) => console.log(`token ${msg.index + k} ${t} ${JSON.stringify(k ? '' : msg.text)}`));
    } else if (msg.finish_reason !== 'FINISH_REASON_UNSPECIFIED') {
      console.log(`finish_reason ${msg.finish_reason} completion_tokens ${msg.usage.completion_tokens}`);
    } else {
      console.log(`request_id ${msg.request_id}`);
    }
  });
  console.log(`stream status ${statusName(end.code)}`);
  if (end.code !== grpc.status.OK) throw new Error(`GenerateStream failed: ${end.details}`);

  // 3. Cancel: start a long stream, cancel it by id after a few tokens; the stream then
  //    ends with status CANCELLED.
  console.log('== Cancel');
  let cancelled = null;
  let cancelError = null;
  const long = await stream(client, request(prompt, 1000), (msg) => {
    if (msg.index === undefined || msg.index === null) return;
    console.log(`token ${msg.index} ${msg.token_id} ${JSON.stringify(msg.text)}`);
    if (cancelled === null && msg.index >= 2) {
      console.log(`cancelling ${msg.request_id}`);
      cancelled = cancel(client, msg.request_id).then(
        (resp) => console.log(`cancel state ${resp.state}`),
        (err) => { cancelError = err; });
    }
  });
  await cancelled;
  if (cancelError) throw cancelError;
  console.log(`stream status ${statusName(long.code)}: ${long.details}`);
  client.close();
  if (long.code !== grpc.status.CANCELLED) throw new Error('the cancelled stream did not end with CANCELLED');
}

main().catch((err) => {
  console.error(`error: ${err.code !== undefined ? statusName(err.code) + ': ' + err.details : err.message}`);
  process.exit(1);
});
