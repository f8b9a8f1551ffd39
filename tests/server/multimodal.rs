//! Chat requests with `image_url` and `input_audio` content parts: each greedy answer equals the
//! library's for the same turn (`Session::prompt` through the chat template), whole and
//! streamed, on the CPU and the GPU; a cached prefix is never reused across different images
//! at the same placeholders; bad media get 400s that say what is wrong.

use super::*;
use markbase::audio::{self as maudio, LoadOptions};
use markbase::engine::{DeviceKind, ModelOptions, Session};
use markbase::generate::GenerateParams;
use markbase::vision::load_image;
use markbase::tokenizer::{ContentPart, PartsMessage};
use markbase::vision::prompt::{Part, Prompt};

const VLM3: &str = "tests/fixtures/vlm/gemma3";
const VLM4: &str = "tests/fixtures/vlm/gemma4";
const CLIP: &str = "tests/fixtures/audio/chirp_16k_s32_stereo.wav";
const TEXT: &str = "What is this? w1 w2";
/// Tokens per answer (stop tokens ignored: every answer has exactly this many).
const TOKENS: usize = 6;

fn file(path: &str) -> Vec<u8> {
    std::fs::read(root().join(path)).unwrap()
}

fn b64(bytes: &[u8]) -> String {
    base64::encode(bytes)
}

fn image_part(path: &str) -> Value {
    json!({"type": "image_url", "image_url": {"url": format!("data:image/png;base64,{}", b64(&file(path)))}})
}

fn audio_part(path: &str) -> Value {
    json!({"type": "input_audio", "input_audio": {"data": b64(&file(path)), "format": "wav"}})
}

fn text_part(t: &str) -> Value {
    json!({"type": "text", "text": t})
}

fn image(path: &str) -> Part {
    Part::Image(load_image(&root().join(path)).unwrap())
}

fn clip(path: &str) -> Part {
    Part::Audio(maudio::load(&root().join(path), &LoadOptions::default()).unwrap())
}

/// The library's greedy answer to one user turn of `parts` through the checkpoint's chat
/// template, stop tokens ignored; the prompt's ids; the log-probabilities after the prompt.
fn library(dir: &str, parts: &[Part], device: DeviceKind) -> (String, Vec<u32>, Vec<f64>) {
    run_library(dir, device, |m| m.prompt(parts, true).unwrap())
}

/// [`library`] of a conversation whose items are the images `images` (files), in order.
fn library_chat(dir: &str, msgs: &[PartsMessage], images: &[&str], device: DeviceKind) -> (String, Vec<u32>, Vec<f64>) {
    let imgs: Vec<_> = images.iter().map(|p| load_image(&root().join(p)).unwrap()).collect();
    run_library(dir, device, |m| {
        let soft = m.encode_images(&imgs).unwrap();
        m.chat_prompt(msgs, soft).unwrap()
    })
}

fn run_library(dir: &str, device: DeviceKind, prompt: impl FnOnce(&Session) -> Prompt) -> (String, Vec<u32>, Vec<f64>) {
    let opts = ModelOptions { device, max_context: 256, ..Default::default() };
    let mut m = Session::load(root().join(dir), opts).unwrap();
    let p = prompt(&m);
    let params = GenerateParams { max_tokens: TOKENS, stop_at_eos: false, ..Default::default() };
    let text = m.generate_prompt(&p, params).unwrap().map(|piece| piece.unwrap().text).collect();
    m.reset();
    let logits = m.forward_with_images(&p.ids, &p.soft, true, None).unwrap().logits.unwrap();
    let last = &logits[logits.len() - m.config.vocab_size..];
    let max = last.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
    let lse = max + last.iter().map(|&x| (x as f64 - max).exp()).sum::<f64>().ln();
    (text, p.ids, last.iter().map(|&x| x as f64 - lse).collect())
}

/// The `top_logprobs` values of an answer's first token, largest first.
fn first_logprobs(v: &Value) -> Vec<f64> {
    let top = v["choices"][0]["logprobs"]["content"][0]["top_logprobs"].as_array().unwrap_or_else(|| panic!("no logprobs: {v}"));
    top.iter().map(|t| t["logprob"].as_f64().unwrap()).collect()
}

/// The `n` largest of `lp`, largest first.
fn top(lp: &[f64], n: usize) -> Vec<f64> {
    let mut v = lp.to_vec();
    v.sort_by(|a, b| b.total_cmp(a));
    v.truncate(n);
    v
}

fn assert_close(got: &[f64], want: &[f64], tol: f64, what: &str) {
    let err = got.iter().zip(want).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
    eprintln!("{what}: first-token log-probabilities {got:?}, library {want:?}, max error {err:.2e}");
    assert!(got.len() == want.len() && err <= tol, "{what}: log-probabilities {got:?} differ from the library's {want:?}");
}

/// A greedy chat turn of `content` (parts), whole and then streamed (with usage): the text
/// (the same both ways), the two usages and the first token's top log-probabilities.
fn chat(s: &Server, content: Value) -> (String, [Value; 2], Vec<f64>) {
    chat_messages(s, json!([{"role": "user", "content": content}]))
}

/// [`chat`] of a conversation.
fn chat_messages(s: &Server, messages: Value) -> (String, [Value; 2], Vec<f64>) {
    let body = json!({"messages": messages, "max_tokens": TOKENS, "temperature": 0, "ignore_eos": true, "logprobs": true, "top_logprobs": 3});
    let (code, v) = s.post("/v1/chat/completions", &body);
    assert_eq!(code, 200, "{v}");
    assert_eq!(v["usage"]["completion_tokens"], TOKENS as u64, "{v}");
    let text = v["choices"][0]["message"]["content"].as_str().unwrap().to_string();
    let mut sb = body.clone();
    sb["stream"] = json!(true);
    sb["stream_options"] = json!({"include_usage": true});
    let (code, _, raw) = s.send("POST", "/v1/chat/completions", &[], sb.to_string().as_bytes());
    assert_eq!(code, 200, "{raw}");
    assert_eq!(streamed_text(&raw, true).0, text, "streamed and whole answers differ");
    let events = sse(&raw);
    let usage: Value = serde_json::from_str(&events[events.len() - 2]).unwrap();
    (text, [v["usage"].clone(), usage["usage"].clone()], first_logprobs(&v))
}

fn cached(u: &Value) -> u64 {
    u["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap()
}

/// One slot, two images at the same placeholders: each answer is its own image's (its text,
/// and the log-probabilities of its first token), whichever ran in the slot before. A
/// conversation's next turn continues the slot's cached tokens: through its image when it is
/// the same image, never when another image sits at the same placeholder ids.
fn images_match_the_library(backend: &str, device: DeviceKind, tol: f64) {
    let s = Server::start_model(VLM3, &["--backend", backend, "--parallel", "1", "--ctx-size", "256"]);
    let (square, wide) = ("tests/fixtures/vlm/gemma3/square.png", "tests/fixtures/vlm/gemma3/wide.png");
    let (want, ids, lp) = library(VLM3, &[image(square), Part::Text(TEXT.into())], device);
    let lp = top(&lp, 3);
    let first = ids.iter().position(|&t| t == 500).unwrap() as u64; // the image token
    let last = ids.iter().rposition(|&t| t == 500).unwrap() as u64;
    // the next turn of a conversation about an image (the reply the first turn gets)
    let turns = |img: &str| {
        let msgs = [PartsMessage::new("user", vec![ContentPart::Image, ContentPart::Text { text: TEXT.into() }]), PartsMessage::text("assistant", &want), PartsMessage::text("user", "w3")];
        let (text, ids, lp) = library_chat(VLM3, &msgs, &[img], device);
        let json = json!([{"role": "user", "content": [image_part(img), text_part(TEXT)]}, {"role": "assistant", "content": want}, {"role": "user", "content": "w3"}]);
        (text, ids, top(&lp, 3), json)
    };
    let (want_sq2, ids_sq2, lp_sq2, sq2) = turns(square);
    let (want_wide2, ids_wide2, lp_wide2, wide2) = turns(wide);
    assert_eq!(ids_sq2, ids_wide2, "the two conversations should differ only in their soft tokens");
    let apart = lp_sq2.iter().zip(&lp_wide2).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
    assert!(apart > 20.0 * tol, "the two images should give different distributions: {lp_sq2:?} {lp_wide2:?}");

    let (got, [u0, _], got_lp) = chat(&s, json!([image_part(square), text_part(TEXT)]));
    assert_eq!(got, want, "{backend}: the server's answer differs from the library's");
    assert_close(&got_lp, &lp, tol, "square");
    assert_eq!(cached(&u0), 0);
    // the same tokens with another image at the placeholders: prefilled again from the image
    let (got, [u0, _], got_lp) = chat_messages(&s, wide2);
    assert_eq!(got, want_wide2, "{backend}: the second turn about another image differs from the library's");
    assert_close(&got_lp, &lp_wide2, tol, "wide's second turn after square's first");
    assert!(cached(&u0) <= first, "a cached prefix was reused across different images: {u0}");
    let (got, [u0, _], got_lp) = chat(&s, json!([image_part(square), text_part(TEXT)]));
    assert_eq!(got, want, "{backend}: the first image's answer changed after the second");
    assert_close(&got_lp, &lp, tol, "square after wide");
    assert!(cached(&u0) <= first, "{u0}");
    // the same image: the next turn reuses the cache through it
    let (got, [u0, _], got_lp) = chat_messages(&s, sq2);
    assert_eq!(got, want_sq2, "{backend}: the second turn differs from the library's");
    assert_close(&got_lp, &lp_sq2, tol, "square's second turn");
    assert!(cached(&u0) > last, "the next turn about the same image should reuse its cached rows: {u0}");
}

#[test]
fn gemma3_images_in_chat_match_the_library_and_never_share_cached_rows() {
    images_match_the_library("cpu", DeviceKind::Cpu, 1e-5);
}

/// The same on the GPU: the prompt's image rows and bidirectional span in the batch's prefill.
#[test]
fn gpu_gemma3_images_in_chat_match_the_library() {
    let backend = std::env::var("MARKBASE_BACKEND").ok().filter(|b| !b.is_empty() && b != "cpu").unwrap_or_else(|| "vulkan".into());
    images_match_the_library(&backend, DeviceKind::Gpu(None), 1e-3);
}

#[test]
fn gemma4_images_and_audio_in_chat_match_the_library() {
    let s = Server::start_model(VLM4, &["--backend", "cpu", "--parallel", "2", "--ctx-size", "256"]);
    let (_, models) = s.get("/v1/models");
    assert!(models.contains(r#""modalities":["text","image","audio"]"#), "{models}");
    let sq = "tests/fixtures/vlm/gemma4/square.png";
    let cases = [
        (vec![image(sq), Part::Text(TEXT.into())], json!([image_part(sq), text_part(TEXT)])),
        (vec![Part::Text(TEXT.into()), clip(CLIP)], json!([text_part(TEXT), audio_part(CLIP)])),
        (vec![clip(CLIP), image(sq), Part::Text(TEXT.into())], json!([audio_part(CLIP), image_part(sq), text_part(TEXT)])),
    ];
    let mut answers = vec![];
    for (parts, content) in cases {
        let (want, _, lp) = library(VLM4, &parts, DeviceKind::Cpu);
        let (got, _, got_lp) = chat(&s, content);
        assert_eq!(got, want, "the server's answer differs from the library's");
        assert_close(&got_lp, &top(&lp, 3), 1e-5, "gemma4");
        answers.push((got, got_lp));
    }
    // the clip's soft tokens are in the prompt: a distribution of its own
    assert!(answers[0].1.iter().zip(&answers[2].1).any(|(a, b)| (a - b).abs() > 1e-3), "{answers:?}");

    // bad clips: 400s naming the problem; the server keeps serving
    let wav = file(CLIP);
    let audio = |data: String, format: &str| json!([{"type": "input_audio", "input_audio": {"data": data, "format": format}}, text_part(TEXT)]);
    let bad = [
        (audio(b64(&wav), "aac"), "unsupported audio format"),
        (audio("%%%not base64%%%".into(), "wav"), "not valid base64"),
        (audio(b64(&wav[..60]), "wav"), "truncated"),
        (audio(b64(b"RIFF\x10\x00\x00\x00WAVEjunkjunk"), "wav"), "WAV"),
        (audio(b64(&[0x55u8; 400]), "mp3"), "mp3 clip"),
        (audio(String::new(), "wav"), "empty"),
        (json!([{"type": "input_audio", "input_audio": {"data": b64(&wav)}}]), "format is required"),
        (json!([{"type": "input_audio"}]), "needs input_audio"),
    ];
    for (content, words) in bad {
        let (code, v) = s.post("/v1/chat/completions", &json!({"messages": [{"role": "user", "content": content}], "max_tokens": 2}));
        assert_eq!(code, 400, "{words}: {v}");
        assert!(error_message(&v).contains(words), "{words}: {v}");
    }
    let (got, _, _) = chat(&s, json!([image_part(sq), text_part(TEXT)]));
    assert_eq!(got, answers[0].0);
}

/// `image_url.detail`: Gemma 4's soft-token budget per image (`low` 70, `high` 1,120, `auto`
/// or none the checkpoint's, here 280); the prompt holds as many soft tokens as the library's
/// encoder makes at that budget; any other detail is a 400.
#[test]
fn gemma4_image_detail_sets_the_soft_token_budget() {
    // the fixture with a budget of 280 (its own is 70, the smallest)
    let dir = std::env::temp_dir().join(format!("markbase-detail-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for e in std::fs::read_dir(root().join(VLM4)).unwrap().map(Result::unwrap).filter(|e| e.path().is_file()) {
        std::fs::copy(e.path(), dir.join(e.file_name())).unwrap();
    }
    let pc = dir.join("preprocessor_config.json");
    let mut v: Value = serde_json::from_str(&std::fs::read_to_string(&pc).unwrap()).unwrap();
    v["max_soft_tokens"] = json!(280);
    std::fs::write(&pc, v.to_string()).unwrap();
    let s = Server::start_model(dir.to_str().unwrap(), &["--backend", "cpu", "--parallel", "1", "--ctx-size", "1024"]);
    let sq = "tests/fixtures/vlm/gemma4/square.png";
    let img = load_image(&root().join(sq)).unwrap();
    let tokens = |budget: Option<usize>| {
        use markbase::vision::processor::{read_processor_config, Gemma4Processor};
        let p = Gemma4Processor::from_config(read_processor_config(&dir).unwrap().as_ref(), budget).unwrap();
        p.process(&img).unwrap().soft_tokens as i64
    };
    let prompt_tokens = |detail: Option<&str>| {
        let mut part = image_part(sq);
        if let Some(d) = detail {
            part["image_url"]["detail"] = json!(d);
        }
        let (code, v) = s.post("/v1/chat/completions", &json!({"messages": [{"role": "user", "content": [part, text_part(TEXT)]}], "max_tokens": 2}));
        assert_eq!(code, 200, "{detail:?}: {v}");
        v["usage"]["prompt_tokens"].as_i64().unwrap()
    };
    let none = prompt_tokens(None);
    let (default, low, high) = (tokens(None), tokens(Some(70)), tokens(Some(1120)));
    assert!(default > 2 * low && high > 2 * default, "{low} {default} {high}");
    assert_eq!(prompt_tokens(Some("auto")), none);
    assert_eq!(prompt_tokens(Some("low")) - none, low - default);
    // 1,120 soft tokens do not fit the context of 1,024: refused before the tower runs
    assert!(high > 1024);
    let mut part = image_part(sq);
    part["image_url"]["detail"] = json!("high");
    let (code, v) = s.post("/v1/chat/completions", &json!({"messages": [{"role": "user", "content": [part, text_part(TEXT)]}], "max_tokens": 2}));
    assert_eq!(code, 400, "{v}");
    assert!(error_message(&v).contains(&format!("images make {high} soft tokens")), "{v}");
    for (detail, words) in [(json!("ultra"), "is not one of"), (json!(3), "must be a string")] {
        let mut part = image_part(sq);
        part["image_url"]["detail"] = detail;
        let (code, v) = s.post("/v1/chat/completions", &json!({"messages": [{"role": "user", "content": [part, text_part(TEXT)]}], "max_tokens": 2}));
        assert_eq!(code, 400, "{words}: {v}");
        assert!(error_message(&v).contains(words), "{words}: {v}");
    }
    drop(s);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bad_images_are_refused_with_clear_errors() {
    let s = Server::start_model(VLM3, &["--backend", "cpu", "--parallel", "1", "--ctx-size", "36"]);
    let png = file("tests/fixtures/vlm/gemma3/square.png");
    let url = |u: String| json!([{"type": "image_url", "image_url": {"url": u}}, text_part("w1")]);
    let bad = [
        (url("https://example.com/cat.png".into()), "remote image URLs are not fetched"),
        (url("http://example.com/cat.png".into()), "remote image URLs are not fetched"),
        (url("file:///tmp/cat.png".into()), "must be a data URL"),
        (url("data:image/png;base64".into()), "no comma"),
        (url(format!("data:image/png,{}", b64(&png))), "base64-encoded"),
        (url(format!("data:image/gif;base64,{}", b64(&png))), "unsupported image type"),
        (url("data:image/png;base64,@@@@".into()), "not valid base64"),
        (url(format!("data:image/png;base64,{}", b64(b"plain text, not an image"))), "not a PNG, JPEG or WebP"),
        (url(format!("data:image/png;base64,{}", b64(&png[..png.len() / 2]))), "cannot be decoded"),
        (url("data:image/png;base64,".into()), "empty"),
        (json!([{"type": "image_url", "image_url": {"detail": "low"}}]), "image_url.url"),
        (json!([{"type": "input_audio", "input_audio": {"data": b64(&file(CLIP)), "format": "wav"}}]), "no audio tower"),
    ];
    for (content, words) in bad {
        let (code, v) = s.post("/v1/chat/completions", &json!({"messages": [{"role": "user", "content": content}], "max_tokens": 2}));
        assert_eq!(code, 400, "{words}: {v}");
        assert!(error_message(&v).contains(words), "{words}: {v}");
        assert_eq!(v["error"]["param"], "messages", "{v}");
    }
    // two images' soft tokens do not fit a context of 36 tokens (--ctx-size)
    let two = json!([image_part("tests/fixtures/vlm/gemma3/square.png"), image_part("tests/fixtures/vlm/gemma3/wide.png"), text_part("w1")]);
    let (code, v) = s.post("/v1/chat/completions", &json!({"messages": [{"role": "user", "content": two}], "max_tokens": 2}));
    assert_eq!(code, 400, "{v}");
    assert_eq!(v["error"]["code"], "context_length_exceeded", "{v}");
    assert!(error_message(&v).contains("context of 36"), "{v}");
    // one still fits
    let one = json!({"messages": [{"role": "user", "content": url(format!("data:image/png;base64,{}", b64(&png)))}], "max_tokens": 2});
    let (code, v) = s.post("/v1/chat/completions", &one);
    assert_eq!(code, 200, "{v}");
    // Gemma 3's image run (16 tokens) attends to itself: it must fit one prefill step
    let s = Server::start_model(VLM3, &["--backend", "cpu", "--parallel", "1", "--ctx-size", "64", "--prefill-chunk", "8"]);
    let (code, v) = s.post("/v1/chat/completions", &one);
    assert_eq!(code, 400, "{v}");
    assert!(error_message(&v).contains("does not fit a prefill step of 8 tokens"), "{v}");
}

/// The official client sends images and audio (`tests/openai_client.py`, its multimodal
/// checks): the answers equal the library's.
#[test]
fn the_openai_python_client_sends_images_and_audio() {
    let python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".into());
    let sq = "tests/fixtures/vlm/gemma4/square.png";
    let (image_reply, _, _) = library(VLM4, &[image(sq), Part::Text(TEXT.into())], DeviceKind::Cpu);
    let (audio_reply, _, _) = library(VLM4, &[Part::Text(TEXT.into()), clip(CLIP)], DeviceKind::Cpu);
    let s = Server::start_model(VLM4, &["--backend", "cpu", "--parallel", "2", "--ctx-size", "256", "--api-key", "k-9"]);
    let out = Command::new(&python)
        .arg(root().join("tests/openai_client.py"))
        .env("MARKBASE_URL", s.url())
        .env("MARKBASE_KEY", "k-9")
        .env("MARKBASE_MODEL", "tiny")
        .env("MARKBASE_MM_IMAGE", root().join(sq))
        .env("MARKBASE_MM_AUDIO", root().join(CLIP))
        .env("MARKBASE_MM_TEXT", TEXT)
        .env("MARKBASE_MM_TOKENS", TOKENS.to_string())
        .env("MARKBASE_MM_IMAGE_REPLY", &image_reply)
        .env("MARKBASE_MM_AUDIO_REPLY", &audio_reply)
        .output()
        .unwrap_or_else(|e| panic!("{python} not found ({e}): the OpenAI client test needs Python 3 with the `openai` package"));
    let stdout = String::from_utf8_lossy(&out.stdout);
    eprintln!("{stdout}{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "the OpenAI client's multimodal checks failed");
    assert!(stdout.contains("all OpenAI client checks passed"), "{stdout}");
}

/// Mutated images and clips (flipped bytes, cuts, spliced headers): every answer is a 200 or a
/// 400 naming the message, never a failure of the server, which keeps serving.
#[test]
fn mutated_images_and_clips_never_break_the_server() {
    let s = Server::start_model(VLM4, &["--backend", "cpu", "--parallel", "2", "--ctx-size", "256"]);
    let (png, wav) = (file("tests/fixtures/vlm/gemma4/square.png"), file(CLIP));
    let cases: usize = std::env::var("MARKBASE_SERVER_MEDIA_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(24);
    let mut r = Rng(0x6d6d_6675_7a7a);
    let (mut ok, mut refused) = (0, 0);
    for i in 0..2 * cases {
        let mut bytes = if i % 2 == 0 { png.clone() } else { wav.clone() };
        match r.below(4) {
            0 => bytes.truncate(r.below(bytes.len())),
            1 => {
                // the header and the first data bytes, where the sizes and formats are
                for _ in 0..1 + r.below(4) {
                    let at = r.below(bytes.len().min(256));
                    bytes[at] = r.next() as u8;
                }
            }
            2 => {
                for _ in 0..1 + r.below(16) {
                    let at = r.below(bytes.len());
                    bytes[at] ^= 1 << r.below(8);
                }
            }
            _ => {
                let at = r.below(bytes.len());
                let junk: Vec<u8> = (0..r.below(64)).map(|_| r.next() as u8).collect();
                bytes.splice(at..at, junk);
            }
        }
        let part = if i % 2 == 0 {
            json!({"type": "image_url", "image_url": {"url": format!("data:image/png;base64,{}", b64(&bytes))}})
        } else {
            json!({"type": "input_audio", "input_audio": {"data": b64(&bytes), "format": "wav"}})
        };
        let body = json!({"messages": [{"role": "user", "content": [part, text_part("w1")]}], "max_tokens": 1});
        let (code, v) = s.post("/v1/chat/completions", &body);
        match code {
            200 => ok += 1,
            400 => {
                refused += 1;
                assert!(error_message(&v).starts_with("messages[0]: ") || v["error"]["code"] == "context_length_exceeded", "case {i}: {v}");
            }
            _ => panic!("case {i}: {code} {v}"),
        }
    }
    eprintln!("mutated media: {ok} answered, {refused} refused");
    assert!(refused > 0);
    assert_eq!(s.get("/health").0, 200);
    let (code, v) = s.post("/v1/chat/completions", &json!({"messages": [{"role": "user", "content": [image_part("tests/fixtures/vlm/gemma4/square.png")]}], "max_tokens": 1}));
    assert_eq!(code, 200, "{v}");
}
