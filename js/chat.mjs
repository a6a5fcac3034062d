// Drives a guarded `useChat` route with the Vercel AI SDK's own client code:
// `DefaultChatTransport` posts the conversation and parses the stream against the SDK's chunk
// schema, `readUIMessageStream` builds the assistant message from it, as `useChat` does.
//
//   node js/chat.mjs <base url> [leave]
//
// Prints one JSON object: `chunks` (the chunk types received, in order), `message` (the last
// message snapshot), `errors` (what the SDK reported: an `error` chunk's errorText, a chunk
// that failed the schema), `thrown` (a request the transport refused: a non-2xx answer).
// With `leave`, the request is aborted after the first text delta: the browser leaving.
import { DefaultChatTransport, readUIMessageStream } from "ai";

const [base, mode] = process.argv.slice(2);
const out = { chunks: [], message: null, errors: [], thrown: null };
const abort = new AbortController();
const transport = new DefaultChatTransport({ api: `${base}/chat`, headers: { "x-user-id": "sdk" } });
try {
  const stream = await transport.sendMessages({
    trigger: "submit-message",
    chatId: "chat-1",
    messageId: undefined,
    messages: [{ id: "m1", role: "user", parts: [{ type: "text", text: "Where is my parcel?" }] }],
    abortSignal: abort.signal,
  });
  const recorded = stream.pipeThrough(
    new TransformStream({
      transform(chunk, controller) {
        out.chunks.push(chunk.type);
        controller.enqueue(chunk);
        if (mode === "leave" && chunk.type === "text-delta") abort.abort();
      },
    }),
  );
  const messages = readUIMessageStream({ stream: recorded, onError: (e) => out.errors.push(String(e?.message ?? e)) });
  for await (const message of messages) out.message = message;
} catch (e) {
  out.thrown = String(e?.message ?? e);
}
process.stdout.write(JSON.stringify(out) + "\n");
