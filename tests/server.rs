//! `markbase serve` as a client sees it: the real binary on a loopback port with a tiny
//! fixture, the API's answers and errors, the scheduler's admission, cancellation and prefix
//! reuse, a fuzz of request bodies, a clean shutdown, and the official `openai` Python client
//! (`tests/openai_client.py`) with a concurrent-streams load test.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

/// Images and audio clips in chat requests, against the tiny vision (and audio) fixtures.
#[path = "server/multimodal.rs"]
mod multimodal;

const FIXTURE: &str = "tests/fixtures/gemma3_text-q4";

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// A running `markbase serve`, killed when dropped.
struct Server {
    child: Child,
    addr: SocketAddr,
    /// The server's stderr lines, as they come.
    log: mpsc::Receiver<String>,
}

impl Server {
    fn start(extra: &[&str]) -> Server {
        Server::start_model(FIXTURE, extra)
    }

    fn start_model(model: &str, extra: &[&str]) -> Server {
        let mut args = vec!["serve", "-m", model, "--port", "0", "--alias", "tiny"];
        args.extend_from_slice(extra);
        let mut child = Command::new(env!("CARGO_BIN_EXE_markbase"))
            .args(&args)
            .current_dir(root())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start markbase serve");
        let (tx, log) = mpsc::channel();
        let err = child.stderr.take().unwrap();
        std::thread::spawn(move || {
            for line in BufReader::new(err).lines().map_while(Result::ok) {
                eprintln!("[server] {line}");
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let deadline = Instant::now() + Duration::from_secs(60);
        let addr = loop {
            let line = log.recv_timeout(deadline.saturating_duration_since(Instant::now())).expect("the server printed no address");
            if let Some(rest) = line.strip_prefix("listening on http://") {
                break rest.split_whitespace().next().unwrap().parse().unwrap();
            }
        };
        let s = Server { child, addr, log };
        while s.get("/health").0 != 200 {
            assert!(Instant::now() < deadline, "the server did not become ready");
            std::thread::sleep(Duration::from_millis(50));
        }
        s
    }

    fn url(&self) -> String {
        format!("http://{}/v1", self.addr)
    }

    fn send(&self, method: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) -> (u16, String, String) {
        http(self.addr, method, path, headers, body)
    }

    fn get(&self, path: &str) -> (u16, String) {
        let (code, _, body) = self.send("GET", path, &[], b"");
        (code, body)
    }

    fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        self.post_with(path, body, &[])
    }

    fn post_with(&self, path: &str, body: &Value, headers: &[(&str, &str)]) -> (u16, Value) {
        let (code, _, text) = self.send("POST", path, headers, body.to_string().as_bytes());
        (code, serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path}: not JSON ({e}): {text}")))
    }

    fn metric(&self, name: &str) -> f64 {
        let (_, text) = self.get("/metrics");
        text.lines().find_map(|l| l.strip_prefix(name).and_then(|r| r.strip_prefix(' ')).and_then(|v| v.trim().parse().ok())).unwrap_or(0.0)
    }

    /// SIGTERM, then waits for the exit (bounded).
    fn terminate(&mut self) -> std::process::ExitStatus {
        let ok = Command::new("kill").args(["-TERM", &self.child.id().to_string()]).status().unwrap().success();
        assert!(ok, "kill -TERM failed");
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                return s;
            }
            assert!(Instant::now() < deadline, "the server did not exit after SIGTERM");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One HTTP/1.1 exchange on a fresh connection (`Connection: close`): status, head, body.
fn http(addr: SocketAddr, method: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) -> (u16, String, String) {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let mut req = format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Length: {}\r\n", body.len());
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    if !headers.iter().any(|(k, _)| k.eq_ignore_ascii_case("content-type")) {
        req.push_str("Content-Type: application/json\r\n");
    }
    req.push_str("\r\n");
    s.write_all(req.as_bytes()).unwrap();
    s.write_all(body).unwrap();
    let mut raw = vec![];
    s.read_to_end(&mut raw).expect("read the response");
    let split = raw.windows(4).position(|w| w == b"\r\n\r\n").expect("a response head");
    let head = String::from_utf8_lossy(&raw[..split]).to_string();
    let mut body = raw[split + 4..].to_vec();
    if head.to_ascii_lowercase().contains("transfer-encoding: chunked") {
        body = dechunk(&body);
    }
    let code = head.split_whitespace().nth(1).and_then(|c| c.parse().ok()).expect("a status code");
    (code, head, String::from_utf8_lossy(&body).into_owned())
}

fn dechunk(mut b: &[u8]) -> Vec<u8> {
    let mut out = vec![];
    while let Some(eol) = b.windows(2).position(|w| w == b"\r\n") {
        let n = usize::from_str_radix(String::from_utf8_lossy(&b[..eol]).trim(), 16).unwrap_or(0);
        if n == 0 {
            break;
        }
        out.extend_from_slice(&b[eol + 2..eol + 2 + n]);
        b = &b[eol + 2 + n + 2..];
    }
    out
}

/// The `data:` payloads of an SSE body.
fn sse(body: &str) -> Vec<String> {
    body.lines().filter_map(|l| l.strip_prefix("data:")).map(|d| d.trim().to_string()).collect()
}

fn streamed_text(body: &str, chat: bool) -> (String, Option<String>) {
    let events = sse(body);
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"), "{body}");
    let mut text = String::new();
    let mut finish = None;
    for e in &events[..events.len() - 1] {
        let v: Value = serde_json::from_str(e).unwrap();
        for c in v["choices"].as_array().unwrap() {
            let t = if chat { &c["delta"]["content"] } else { &c["text"] };
            text.push_str(t.as_str().unwrap_or(""));
            if let Some(f) = c["finish_reason"].as_str() {
                finish = Some(f.to_string());
            }
        }
    }
    (text, finish)
}

fn error_message(v: &Value) -> &str {
    v["error"]["message"].as_str().unwrap_or_else(|| panic!("no OpenAI-style error: {v}"))
}

#[test]
fn serves_completions_and_chat_and_refuses_bad_requests() {
    let s = Server::start(&["--backend", "cpu", "--api-key", "sekrit", "--parallel", "3", "--ctx-size", "96"]);
    let auth = [("Authorization", "Bearer sekrit")];
    // keys: missing and wrong ones are refused; health and metrics are open
    let (code, v) = s.post("/v1/completions", &json!({"prompt": "w1", "max_tokens": 2}));
    assert_eq!(code, 401, "{v}");
    assert!(error_message(&v).contains("API key"));
    let (code, v) = s.post_with("/v1/completions", &json!({"prompt": "w1"}), &[("Authorization", "Bearer nope")]);
    assert_eq!(code, 401, "{v}");
    assert_eq!(s.get("/health").0, 200);
    assert_eq!(s.get("/metrics").0, 200);
    let (code, _, models) = s.send("GET", "/v1/models", &auth, b"");
    assert_eq!(code, 200);
    let models: Value = serde_json::from_str(&models).unwrap();
    assert_eq!(models["data"][0]["id"], "tiny");

    // a greedy completion is what `markbase generate` writes
    let prompt = "w1 w2 w3";
    let body = json!({"model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0});
    let (code, v) = s.post_with("/v1/completions", &body, &auth);
    assert_eq!(code, 200, "{v}");
    let text = v["choices"][0]["text"].as_str().unwrap().to_string();
    let out = Command::new(env!("CARGO_BIN_EXE_markbase"))
        .args(["generate", "-m", FIXTURE, "--backend", "cpu", "-p", prompt, "--max-tokens", "6"])
        .current_dir(root())
        .output()
        .unwrap();
    let cli = String::from_utf8_lossy(&out.stdout);
    assert_eq!(cli.trim_end_matches('\n'), format!("{prompt}{text}"), "the server and the CLI differ");
    let u = &v["usage"];
    assert_eq!(u["total_tokens"], u["prompt_tokens"].as_u64().unwrap() + u["completion_tokens"].as_u64().unwrap());
    assert!(u["completion_tokens"].as_u64().unwrap() <= 6);
    let finish = v["choices"][0]["finish_reason"].as_str().unwrap();
    assert!(finish == "length" || finish == "stop", "{v}");

    // the same, streamed
    let mut sbody = body.clone();
    sbody["stream"] = json!(true);
    let (code, head, raw) = s.send("POST", "/v1/completions", &auth, sbody.to_string().as_bytes());
    assert_eq!(code, 200, "{raw}");
    assert!(head.to_ascii_lowercase().contains("text/event-stream"), "{head}");
    assert_eq!(streamed_text(&raw, false), (text.clone(), Some(finish.to_string())));

    // ignore_eos and max_tokens: exactly that many tokens, finish_reason length
    let (code, v) = s.post_with("/v1/completions", &json!({"prompt": [2, 5, 9], "max_tokens": 7, "ignore_eos": true, "temperature": 0}), &auth);
    assert_eq!(code, 200, "{v}");
    assert_eq!(v["usage"]["completion_tokens"], 7);
    assert_eq!(v["usage"]["prompt_tokens"], 3);
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    let long_text = v["choices"][0]["text"].as_str().unwrap().to_string();

    // a stop string ends the text before it
    let chars: Vec<char> = long_text.chars().collect();
    if chars.len() >= 4 {
        let stop: String = chars[chars.len() / 2..chars.len() / 2 + 2].iter().collect();
        let (code, v) = s.post_with("/v1/completions", &json!({"prompt": [2, 5, 9], "max_tokens": 7, "ignore_eos": true, "temperature": 0, "stop": [stop.clone()]}), &auth);
        assert_eq!(code, 200, "{v}");
        let want = &long_text[..long_text.find(&stop).unwrap()];
        assert_eq!(v["choices"][0]["text"], want, "stop {stop:?} in {long_text:?}");
        assert_eq!(v["choices"][0]["finish_reason"], "stop");
    }

    // seeded sampling repeats; log-probabilities come per token, the top ones sorted
    let seeded = json!({"prompt": [2, 5, 9], "max_tokens": 8, "temperature": 1.0, "top_k": 40, "seed": 7, "ignore_eos": true, "logprobs": 3});
    let (c1, a) = s.post_with("/v1/completions", &seeded, &auth);
    let (c2, b) = s.post_with("/v1/completions", &seeded, &auth);
    assert_eq!((c1, c2), (200, 200), "{a} {b}");
    assert_eq!(a["choices"][0]["text"], b["choices"][0]["text"]);
    let lp = &a["choices"][0]["logprobs"];
    assert_eq!(lp["token_logprobs"].as_array().unwrap().len(), 8, "{lp}");
    for (tok_lp, top) in lp["token_logprobs"].as_array().unwrap().iter().zip(lp["top_logprobs"].as_array().unwrap()) {
        assert!(tok_lp.as_f64().unwrap() <= 1e-6);
        let vals: Vec<f64> = top.as_object().unwrap().values().map(|x| x.as_f64().unwrap()).collect();
        let best = vals.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        assert!(!vals.is_empty() && vals.len() <= 3 && best <= 1e-6 && tok_lp.as_f64().unwrap() <= best + 1e-6, "{top}");
    }

    // chat, whole and streamed (Gemma's turn format: the fixture has no template)
    let chat = json!({"model": "tiny", "messages": [{"role": "system", "content": "w4"}, {"role": "user", "content": "w1 w2"}], "max_tokens": 5, "temperature": 0, "logprobs": true, "top_logprobs": 2});
    let (code, v) = s.post_with("/v1/chat/completions", &chat, &auth);
    assert_eq!(code, 200, "{v}");
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    let reply = v["choices"][0]["message"]["content"].as_str().unwrap().to_string();
    let n = v["usage"]["completion_tokens"].as_u64().unwrap() as usize;
    let lps = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert!(lps.len() == n && lps.iter().all(|l| l["top_logprobs"].as_array().unwrap().len() == 2), "{v}");
    let mut sc = chat.clone();
    sc["stream"] = json!(true);
    sc["stream_options"] = json!({"include_usage": true});
    let (code, _, raw) = s.send("POST", "/v1/chat/completions", &auth, sc.to_string().as_bytes());
    assert_eq!(code, 200, "{raw}");
    assert_eq!(streamed_text(&raw, true).0, reply);
    let events = sse(&raw);
    let usage: Value = serde_json::from_str(&events[events.len() - 2]).unwrap();
    assert_eq!(usage["usage"]["completion_tokens"], n as u64, "{raw}");

    // errors, in OpenAI's shape
    let bad: &[(&str, &[u8], u16, &str)] = &[
        ("/v1/completions", b"{\"prompt\": \"w1\"", 400, "not valid JSON"),
        ("/v1/completions", b"", 400, "no body"),
        ("/v1/completions", b"[1, 2]", 400, "JSON object"),
        ("/v1/completions", b"{\"prompt\": \"w1\", \"temperature\": \"hot\"}", 400, "invalid type"),
        ("/v1/completions", b"{\"prompt\": \"w1\", \"max_tokens\": -3}", 400, "invalid"),
        ("/v1/completions", b"{\"prompt\": \"w1\", \"top_p\": 7}", 400, "top-p"),
        ("/v1/completions", b"{\"prompt\": \"w1\", \"n\": 2}", 400, "one choice"),
        ("/v1/completions", b"{\"prompt\": [2, 99999]}", 400, "outside the vocabulary"),
        ("/v1/completions", b"{\"model\": \"gpt-4\", \"prompt\": \"w1\"}", 404, "does not exist"),
        ("/v1/completions", b"{\"max_tokens\": 3}", 400, "prompt is required"),
        ("/v1/chat/completions", b"{\"messages\": []}", 400, "must not be empty"),
        ("/v1/chat/completions", b"{\"messages\": [{\"role\": \"wizard\", \"content\": \"x\"}]}", 400, "unsupported role"),
        ("/v1/chat/completions", b"{\"messages\": [{\"role\": \"user\", \"content\": [{\"type\": \"image_url\"}]}]}", 400, "no vision tower"),
        ("/v1/chat/completions", b"{\"messages\": [{\"role\": \"user\", \"content\": [{\"type\": \"input_audio\"}]}]}", 400, "no audio tower"),
        ("/v1/chat/completions", b"{\"messages\": [{\"role\": \"user\", \"content\": [{\"type\": \"video_url\"}]}]}", 400, "not supported"),
        ("/v1/nothing", b"{}", 404, "no such endpoint"),
    ];
    for (path, body, want, words) in bad {
        let (code, _, text) = s.send("POST", path, &auth, body);
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|_| panic!("{path} {}: not JSON: {text}", String::from_utf8_lossy(body)));
        assert_eq!(code, *want, "{}: {v}", String::from_utf8_lossy(body));
        assert!(error_message(&v).contains(words), "{}: {v}", String::from_utf8_lossy(body));
    }
    // a prompt longer than the context (96 tokens) says so
    let long: Vec<u32> = (0..200).map(|i| 4 + i % 300).collect();
    let (code, v) = s.post_with("/v1/completions", &json!({"prompt": long}), &auth);
    assert_eq!(code, 400, "{v}");
    assert!(error_message(&v).contains("200 tokens") && error_message(&v).contains("context of 96"), "{v}");
    assert_eq!(v["error"]["code"], "context_length_exceeded");
    let (code, _, _) = s.send("GET", "/v1/completions", &auth, b"");
    assert_eq!(code, 405);

    // the metrics saw it all
    let (_, m) = s.get("/metrics");
    for name in [
        "markbase_prompt_tokens_total",
        "markbase_generation_tokens_total",
        "markbase_num_requests_waiting",
        "markbase_num_requests_running",
        "markbase_kv_cache_usage_ratio",
        "markbase_time_to_first_token_seconds_bucket",
        "markbase_inter_token_latency_seconds_bucket",
        "markbase_http_requests_total{path=\"/v1/completions\",code=\"401\"}",
    ] {
        assert!(m.contains(name), "{name} missing:\n{m}");
    }
    assert!(s.metric("markbase_generation_tokens_total") >= 40.0, "{m}");
    assert_eq!(s.metric("markbase_num_requests_running"), 0.0);
}

#[test]
fn prefix_reuse_and_a_clean_shutdown() {
    let mut s = Server::start(&["--backend", "cpu", "--parallel", "1", "--ctx-size", "1024"]);
    // a cached prefix is reused: the second prompt continues the first one's tokens
    let (_, a) = s.post("/v1/completions", &json!({"prompt": [2, 5, 9, 11], "max_tokens": 1, "temperature": 0}));
    assert_eq!(a["usage"]["prompt_tokens_details"]["cached_tokens"], 0, "{a}");
    let follow = json!({"prompt": [2, 5, 9, 11, 17, 23], "max_tokens": 6, "temperature": 0, "ignore_eos": true});
    let (_, b) = s.post("/v1/completions", &follow);
    assert_eq!(b["usage"]["prompt_tokens_details"]["cached_tokens"], 4, "{b}");
    let (_, _) = s.post("/v1/completions", &json!({"prompt": [2, 40, 41, 42, 43, 44, 45, 46, 47, 48], "max_tokens": 4, "temperature": 0}));
    let (_, c) = s.post("/v1/completions", &follow);
    assert!(c["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap() < 4, "{c}");
    assert_eq!(b["choices"][0]["text"], c["choices"][0]["text"], "a reused prefix changed the output");
    assert!(s.metric("markbase_prompt_tokens_cached_total") >= 4.0);

    // SIGTERM: the running stream finishes, then the server exits cleanly
    let s_addr = s.addr;
    let streamer = std::thread::spawn(move || {
        let body = json!({"prompt": [2, 5, 9], "max_tokens": 1000, "ignore_eos": true, "stream": true, "temperature": 0});
        http(s_addr, "POST", "/v1/completions", &[], body.to_string().as_bytes())
    });
    let deadline = Instant::now() + Duration::from_secs(20);
    while s.metric("markbase_num_requests_running") < 1.0 {
        assert!(Instant::now() < deadline, "the stream did not start");
        std::thread::sleep(Duration::from_millis(2));
    }
    let status = s.terminate();
    assert!(status.success(), "exit status {status}");
    let (code, _, raw) = streamer.join().unwrap();
    assert_eq!(code, 200);
    let events = sse(&raw);
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"), "the stream was cut: {raw}");
    let (_, finish) = streamed_text(&raw, false);
    assert_eq!(finish.as_deref(), Some("length"));
    let lines: Vec<String> = s.log.try_iter().collect();
    assert!(lines.iter().any(|l| l.contains("stopped")), "{lines:?}");
    assert!(TcpStream::connect(s.addr).is_err(), "still listening after SIGTERM");
}

/// Opens a streaming completion and returns the connection once its first bytes arrived.
fn open_stream(addr: SocketAddr, body: &Value) -> TcpStream {
    let mut stream = TcpStream::connect(addr).unwrap();
    stream.set_read_timeout(Some(Duration::from_secs(300))).unwrap();
    let body = body.to_string();
    write!(stream, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}", body.len()).unwrap();
    let mut got = vec![];
    let mut buf = [0u8; 4096];
    // the head, and the first token's event
    while !String::from_utf8_lossy(&got).contains("data:") {
        let n = stream.read(&mut buf).unwrap();
        assert!(n > 0, "the stream closed: {}", String::from_utf8_lossy(&got));
        got.extend_from_slice(&buf[..n]);
    }
    assert!(got.starts_with(b"HTTP/1.1 200"), "{}", String::from_utf8_lossy(&got));
    stream
}

/// On the GPU (lavapipe in CI): concurrent sequences match each alone; a full server answers
/// 429 with Retry-After; clients that go away free their sequences.
#[test]
fn gpu_streams_match_alone_and_admission_and_disconnects_work() {
    let backend = std::env::var("MARKBASE_BACKEND").ok().filter(|b| !b.is_empty() && b != "cpu").unwrap_or_else(|| "vulkan".into());
    let s = Server::start(&["--backend", &backend, "--parallel", "2", "--max-queue", "0", "--ctx-size", "512"]);
    let req = |i: u32| json!({"prompt": [2, 5 + i, 9, 11 + i], "max_tokens": 6, "temperature": 0, "ignore_eos": true});
    let alone: Vec<Value> = (0..2).map(|i| s.post("/v1/completions", &req(i)).1).collect();
    let together = completions_at_once(&s, (0..2).map(req).collect());
    for (a, t) in alone.iter().zip(&together) {
        assert_eq!(a["usage"]["completion_tokens"], 6, "{a}");
        assert_eq!(a["choices"][0]["text"], t["choices"][0]["text"], "concurrent output differs from alone");
    }
    assert_ne!(alone[0]["choices"][0]["text"], alone[1]["choices"][0]["text"], "the prompts should continue differently");

    // both slots busy, no queue: 429 with Retry-After
    let before = s.metric("markbase_generation_tokens_total");
    let long = json!({"prompt": [2, 5, 9], "max_tokens": 500, "ignore_eos": true, "stream": true, "temperature": 0});
    let streams = [open_stream(s.addr, &long), open_stream(s.addr, &long)];
    let (code, head, text) = s.send("POST", "/v1/completions", &[], br#"{"prompt": "w1", "max_tokens": 2}"#);
    assert_eq!(code, 429, "{text}");
    assert!(head.to_ascii_lowercase().contains("retry-after: 1"), "{head}");
    assert!(error_message(&serde_json::from_str(&text).unwrap()).contains("capacity"));
    // the clients go away mid-stream: their sequences are freed, the slots serve the next
    drop(streams);
    let deadline = Instant::now() + Duration::from_secs(30);
    while s.metric("markbase_requests_finished_total{reason=\"cancelled\"}") < 2.0 {
        assert!(Instant::now() < deadline, "the cancelled streams were not freed");
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(s.metric("markbase_generation_tokens_total") - before < 1000.0, "the cancelled streams ran to their end");
    assert_eq!(s.metric("markbase_num_requests_running"), 0.0);
    // so does a client waiting for a whole answer
    let before = s.metric("markbase_generation_tokens_total");
    let mut whole = TcpStream::connect(s.addr).unwrap();
    let body = json!({"prompt": [2, 5, 9], "max_tokens": 500, "ignore_eos": true}).to_string();
    write!(whole, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}", body.len()).unwrap();
    while s.metric("markbase_generation_tokens_total") == before {
        assert!(Instant::now() < deadline, "the request did not start");
        std::thread::sleep(Duration::from_millis(10));
    }
    drop(whole);
    while s.metric("markbase_requests_finished_total{reason=\"cancelled\"}") < 3.0 {
        assert!(Instant::now() < deadline, "the abandoned request was not freed");
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(s.metric("markbase_generation_tokens_total") - before < 500.0, "the abandoned request ran to its end");
    let (code, v) = s.post("/v1/completions", &json!({"prompt": "w1", "max_tokens": 2}));
    assert_eq!(code, 200, "{v}");
}

/// 16 concurrent requests on the GPU (one batched decode step for all of them), greedy and
/// seeded sampling, each answer identical to the same request sent alone.
#[test]
fn gpu_sixteen_concurrent_requests_match_alone() {
    let backend = std::env::var("MARKBASE_BACKEND").ok().filter(|b| !b.is_empty() && b != "cpu").unwrap_or_else(|| "vulkan".into());
    let s = Server::start(&["--backend", &backend, "--parallel", "16", "--ctx-size", "128", "--prefill-chunk", "8"]);
    let req = |i: u32| {
        let prompt: Vec<u32> = std::iter::once(2).chain((0..1 + i % 11).map(|j| 3 + (i * 37 + j * 11) % 400)).collect();
        let temperature = if i % 3 == 1 { 0.8 } else { 0.0 };
        json!({"prompt": prompt, "max_tokens": 12, "temperature": temperature, "seed": 100 + i, "ignore_eos": true})
    };
    let alone: Vec<Value> = (0..16).map(|i| s.post("/v1/completions", &req(i)).1).collect();
    let together = completions_at_once(&s, (0..16).map(req).collect());
    for (i, (a, t)) in alone.iter().zip(&together).enumerate() {
        assert_eq!(a["usage"]["completion_tokens"], 12, "{a}");
        assert_eq!(a["choices"][0]["text"], t["choices"][0]["text"], "request {i}: concurrent output differs from alone");
    }
    let distinct: std::collections::HashSet<String> = alone.iter().map(|a| a["choices"][0]["text"].to_string()).collect();
    assert!(distinct.len() > 8, "the requests should continue differently");
}

/// `--synthetic`: a model in real shapes with random weights (what throughput is measured on)
/// served with a checkpoint's tokenizer; its answers on the GPU, four at once, are the same as
/// alone. An unknown shape, or a directory without a tokenizer, is refused with a clear error.
#[test]
fn gpu_serves_a_synthetic_model_with_a_checkpoints_tokenizer() {
    let backend = std::env::var("MARKBASE_BACKEND").ok().filter(|b| !b.is_empty() && b != "cpu").unwrap_or_else(|| "vulkan".into());
    let s = Server::start(&["--synthetic", "tiny-gemma3", "--backend", &backend, "--parallel", "4", "--ctx-size", "64"]);
    let req = |i: u32| json!({"prompt": format!("w{} w{}", i + 1, 7 * i + 3), "max_tokens": 6, "temperature": 0, "ignore_eos": true});
    let alone: Vec<Value> = (0..4).map(|i| s.post("/v1/completions", &req(i)).1).collect();
    let together = completions_at_once(&s, (0..4).map(req).collect());
    for (i, (a, t)) in alone.iter().zip(&together).enumerate() {
        assert_eq!(a["usage"]["completion_tokens"], 6, "{a}");
        assert_eq!(a["usage"]["prompt_tokens"], 3, "{a}");
        assert_eq!(a["choices"][0]["text"], t["choices"][0]["text"], "request {i}: concurrent output differs from alone");
    }
    let refused = |args: &[&str], want: &str| {
        let out = Command::new(env!("CARGO_BIN_EXE_markbase")).args(args).current_dir(root()).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains(want) && !err.contains("panicked"), "{args:?}: {err}");
    };
    refused(&["serve", "-m", FIXTURE, "--synthetic", "gemma9-1b", "--port", "0"], "unknown synthetic model");
    refused(&["serve", "-m", "tests/fixtures/images", "--synthetic", "tiny-gemma3", "--port", "0"], "tokenizer.json");
}

/// A small deterministic generator (no seed crate needed for the fuzz).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

fn random_value(r: &mut Rng, depth: usize) -> Value {
    match r.below(if depth > 2 { 8 } else { 10 }) {
        0 => Value::Null,
        1 => json!(r.below(2) == 1),
        2 => json!(r.next() as i64),
        3 => json!(r.below(40) as i64 - 5),
        4 => json!((r.next() % 10_000) as f64 / 997.0 - 3.0),
        5 => json!(["", "w1", "\u{0}\u{ffff}", "é漢字🙂", "<start_of_turn>", "user"][r.below(6)]),
        6 => json!(1e300),
        7 => json!("x".repeat(r.below(3000))),
        8 => Value::Array((0..r.below(4)).map(|_| random_value(r, depth + 1)).collect()),
        _ => {
            let keys = ["role", "content", "type", "text", "include_usage", "prompt", "x"];
            Value::Object((0..r.below(4)).map(|_| (keys[r.below(keys.len())].to_string(), random_value(r, depth + 1))).collect())
        }
    }
}

fn mutate(r: &mut Rng, base: &Value) -> Vec<u8> {
    const FIELDS: &[&str] = &[
        "model", "messages", "prompt", "stream", "stream_options", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p",
        "stop", "seed", "n", "logprobs", "top_logprobs", "ignore_eos", "repetition_penalty", "presence_penalty", "response_format", "tools",
    ];
    match r.below(4) {
        // typed mutation: fields replaced by random values
        0 | 1 => {
            let mut v = base.clone();
            for _ in 0..1 + r.below(3) {
                let f = FIELDS[r.below(FIELDS.len())];
                v[f] = random_value(r, 0);
            }
            // keep generations short, so that the fuzz spends its time on parsing
            if v.get("max_tokens").and_then(|m| m.as_u64()).is_some_and(|m| m > 8) {
                v["max_tokens"] = json!(8);
            }
            v.to_string().into_bytes()
        }
        // byte mutation of a valid body
        2 => {
            let mut b = base.to_string().into_bytes();
            for _ in 0..1 + r.below(4) {
                let i = r.below(b.len());
                match r.below(3) {
                    0 => b[i] = r.next() as u8,
                    1 => {
                        b.remove(i);
                    }
                    _ => b.insert(i, b"{}[]\",:0-e\\"[r.below(11)]),
                }
            }
            b
        }
        // random bytes
        _ => (0..r.below(200)).map(|_| r.next() as u8).collect(),
    }
}

#[test]
fn random_and_mutated_bodies_never_break_the_server() {
    let s = Server::start(&["--backend", "cpu", "--parallel", "4", "--max-queue", "64", "--ctx-size", "48"]);
    let bases = [
        json!({"model": "tiny", "prompt": "w1 w2", "max_tokens": 4, "temperature": 0}),
        json!({"model": "tiny", "messages": [{"role": "user", "content": "w1"}], "max_tokens": 4, "stream": true}),
        json!({"prompt": [2, 5, 9], "max_tokens": 3, "logprobs": 2, "stop": ["w"]}),
        json!({"messages": [{"role": "user", "content": [{"type": "text", "text": "w2"}]}], "max_tokens": 3, "logprobs": true, "top_logprobs": 1}),
    ];
    let max_cases: usize = std::env::var("MARKBASE_SERVER_FUZZ_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(3000);
    let t0 = Instant::now();
    let addr = s.addr;
    let workers: Vec<_> = (0..3u64)
        .map(|w| {
            let bases = bases.clone();
            std::thread::spawn(move || {
                let mut r = Rng(0x9e37_79b9_7f4a_7c15 ^ (w + 1).wrapping_mul(0x2545_f491_4f6c_dd1d));
                let mut seen = std::collections::BTreeMap::<u16, usize>::new();
                let mut n = 0;
                while n < max_cases / 3 {
                    let base = &bases[r.below(bases.len())];
                    let body = mutate(&mut r, base);
                    let path = ["/v1/completions", "/v1/chat/completions"][r.below(2)];
                    let (code, _, text) = http(addr, "POST", path, &[], &body);
                    assert!(
                        [200, 400, 404, 429].contains(&code),
                        "{path} answered {code} to {}: {text}",
                        String::from_utf8_lossy(&body)
                    );
                    if code != 200 {
                        let v: Value = serde_json::from_str(&text).unwrap_or_else(|_| panic!("{code} without a JSON body: {text}"));
                        assert!(v["error"]["message"].is_string(), "{v}");
                    }
                    *seen.entry(code).or_default() += 1;
                    n += 1;
                }
                (n, seen)
            })
        })
        .collect();
    let mut total = 0;
    let mut seen = std::collections::BTreeMap::<u16, usize>::new();
    for w in workers {
        let (n, s) = w.join().expect("a fuzz worker failed");
        total += n;
        for (k, v) in s {
            *seen.entry(k).or_default() += v;
        }
    }
    eprintln!("{total} bodies in {:.1}s: {seen:?}", t0.elapsed().as_secs_f64());
    assert!(seen.get(&200).is_some_and(|&n| n > 0) && seen.get(&400).is_some_and(|&n| n > 0), "{seen:?}");
    // still healthy and still right
    assert_eq!(s.get("/health").0, 200);
    let (code, v) = s.post("/v1/completions", &json!({"prompt": "w1", "max_tokens": 2}));
    assert_eq!(code, 200, "{v}");
}

#[test]
fn the_openai_python_client_works_against_the_server() {
    let python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".into());
    let probe = Command::new(&python).args(["-c", "import openai; print(openai.__version__)"]).output();
    match probe {
        Err(e) => panic!("{python} not found ({e}): the OpenAI client test needs Python 3 with the `openai` package (tools/test.sh installs it)"),
        Ok(o) if !o.status.success() => panic!(
            "the Python package `openai` is missing ({}): tools/test.sh installs it, or `pip install openai`",
            String::from_utf8_lossy(&o.stderr).lines().last().unwrap_or("")
        ),
        Ok(_) => {}
    }
    let mut s = Server::start(&["--backend", "cpu", "--parallel", "8", "--max-queue", "32", "--ctx-size", "256", "--api-key", "k-123"]);
    let out = Command::new(&python)
        .arg(root().join("tests/openai_client.py"))
        .env("MARKBASE_URL", s.url())
        .env("MARKBASE_KEY", "k-123")
        .env("MARKBASE_MODEL", "tiny")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    eprintln!("{stdout}{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "the OpenAI client test failed");
    assert!(stdout.contains("all OpenAI client checks passed"), "{stdout}");
    let status = s.terminate();
    assert!(status.success(), "exit status {status}");
}

/// The scheduler itself: a long prompt is fed a chunk per step between the decode steps of a
/// running sequence (which keeps getting tokens), and comes out as it does alone.
#[test]
fn long_prompts_are_prefilled_in_chunks_between_decode_steps() {
    use markbase::engine::{DeviceKind, Engine, ModelOptions, SampleParams};
    use markbase::server::metrics::Metrics;
    use markbase::server::scheduler::{Event, Request, Scheduler};
    let opts = ModelOptions { device: DeviceKind::Cpu, max_context: 1024, prefill_chunk: 16, ..Default::default() };
    let engine = Engine::load(root().join(FIXTURE), opts).unwrap();
    let (sched, worker) = Scheduler::start(engine, 2, 4, std::sync::Arc::new(Metrics::default())).unwrap();
    let req = |prompt: Vec<u32>, max_tokens| Request { prompt, max_tokens, sampling: SampleParams::default(), stop: vec![], ignore_eos: true, logprobs: None, soft: vec![] };
    let text = |rx: &mut tokio::sync::mpsc::UnboundedReceiver<Event>| {
        let mut t = String::new();
        while let Some(e) = rx.blocking_recv() {
            match e {
                Event::Token { text, .. } => t.push_str(&text),
                Event::Done { .. } => return t,
                Event::Error(e) => panic!("{e}"),
            }
        }
        panic!("no Done event")
    };
    // 600 prompt tokens: 37 full chunks of 16, then the rest
    let long: Vec<u32> = std::iter::once(2).chain((0..599).map(|i| 4 + (i * 37) % 500)).collect();
    let alone = text(&mut sched.submit(req(long.clone(), 8)).unwrap());

    let mut a = sched.submit(req(vec![2, 5, 9], 900)).unwrap();
    assert!(matches!(a.blocking_recv(), Some(Event::Token { .. })));
    let mut b = sched.submit(req(long, 8)).unwrap();
    let mut during = 0;
    let first_b = loop {
        match b.try_recv() {
            Ok(e) => break e,
            Err(tokio::sync::mpsc::error::TryRecvError::Empty) => {}
            Err(e) => panic!("{e}"),
        }
        while let Ok(e) = a.try_recv() {
            assert!(matches!(e, Event::Token { .. }), "{e:?}");
            during += 1;
        }
        std::thread::yield_now();
    };
    // one chunk per step: the running sequence got a token in (nearly) every step of the prefill
    assert!(during >= 30, "the running sequence got {during} tokens during a 38-step prefill");
    let mut got = match first_b {
        Event::Token { text, .. } => text,
        e => panic!("{e:?}"),
    };
    got.push_str(&text(&mut b));
    assert_eq!(got, alone, "a prompt prefilled beside a running sequence differs from alone");
    drop(a);
    sched.drain();
    worker.join().unwrap();
}

/// The real Gemma 3 270M (`tools/setup-real-model.sh` prepares models/; without it this test
/// fails): 8 concurrent greedy streams, chat and completions, each token-identical to its
/// request run alone.
#[test]
fn real_gemma3_270m_concurrent_streams_match_alone() {
    let dir = root().join("models/gemma3-270m-q4");
    assert!(dir.join("model.safetensors").exists(), "{} missing: run tools/setup-real-model.sh", dir.display());
    let dir = dir.to_string_lossy().into_owned();
    let mut args = vec!["serve", "-m", dir.as_str(), "--port", "0", "--backend", "cpu", "--parallel", "8", "--ctx-size", "512"];
    args.extend_from_slice(&["--alias", "gemma"]);
    let child = Command::new(env!("CARGO_BIN_EXE_markbase")).args(&args).stderr(Stdio::piped()).stdout(Stdio::null()).spawn().unwrap();
    // killed when the test ends, failed or not
    let mut child = KillOnDrop(child);
    let err = child.0.stderr.take().unwrap();
    let mut lines = BufReader::new(err).lines();
    let addr: SocketAddr = loop {
        let l = lines.next().expect("the server exited").unwrap();
        if let Some(rest) = l.strip_prefix("listening on http://") {
            break rest.split_whitespace().next().unwrap().parse().unwrap();
        }
    };
    std::thread::spawn(move || lines.for_each(drop));
    let deadline = Instant::now() + Duration::from_secs(120);
    while http(addr, "GET", "/health", &[], b"").0 != 200 {
        assert!(Instant::now() < deadline, "the real model did not load");
        std::thread::sleep(Duration::from_millis(100));
    }
    let starts = ["The capital of France is", "Once upon a time, in a small village by the sea,", "The three primary colors are", "Water boils at"];
    let body = move |i: usize| {
        if i.is_multiple_of(2) {
            json!({"prompt": starts[i / 2 % 4], "max_tokens": 16, "temperature": 0, "ignore_eos": true, "stream": true})
        } else {
            json!({"messages": [{"role": "user", "content": starts[i / 2 % 4]}], "max_tokens": 16, "temperature": 0, "ignore_eos": true, "stream": true})
        }
    };
    let run = move |i: usize| {
        let path = if i.is_multiple_of(2) { "/v1/completions" } else { "/v1/chat/completions" };
        let (code, _, raw) = http(addr, "POST", path, &[], body(i).to_string().as_bytes());
        assert_eq!(code, 200, "{raw}");
        streamed_text(&raw, i % 2 == 1).0
    };
    let alone: Vec<String> = (0..8).map(run).collect();
    let together: Vec<String> = (0..8).map(|i| std::thread::spawn(move || run(i))).collect::<Vec<_>>().into_iter().map(|h| h.join().unwrap()).collect();
    assert!(alone.iter().all(|t| !t.is_empty()) && alone[0] != alone[2], "{alone:?}");
    for (i, (a, t)) in alone.iter().zip(&together).enumerate() {
        assert_eq!(a, t, "stream {i}: concurrent output differs from alone");
    }
    drop(child);
}

struct KillOnDrop(Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Posts each body to `/v1/completions` at once, one thread each; the responses (each a 200), in order.
fn completions_at_once(s: &Server, bodies: Vec<Value>) -> Vec<Value> {
    let addr = s.addr;
    let handles: Vec<_> = bodies.into_iter().map(|b| std::thread::spawn(move || http(addr, "POST", "/v1/completions", &[], b.to_string().as_bytes()))).collect();
    handles
        .into_iter()
        .map(|h| {
            let (code, _, body) = h.join().unwrap();
            assert_eq!(code, 200, "{body}");
            serde_json::from_str(&body).unwrap()
        })
        .collect()
}
