//! The scheduler: one engine thread owns a [`Batch`] of sequence slots (one KV cache of all
//! the slots, allocated once) and a bounded queue of waiting requests. Each step it
//!
//! 1. drops sequences whose client went away (their slot is free for the next request),
//! 2. admits waiting requests into free slots, reusing the longest cached prompt prefix a
//!    free slot still holds (a shared system prompt is not prefilled again; placeholders of
//!    images and clips count as the same only with the same soft tokens),
//! 3. runs one prefill chunk (the engine's prefill chunk of tokens) of the oldest requests
//!    still prefilling, so a long prompt delays running streams by one chunk per step at most,
//! 4. advances every decoding sequence by one token, all of them in one batched decode step
//!    (one row each: every matmul multiplies the weights with all the rows at once).
//!
//! Prompts are cut at the same positions whatever else runs, each row of a decode step is
//! computed as it would be alone (see [`crate::batch`]), and each sequence samples with its own
//! counter, so a request's output does not depend on what runs beside it.

use std::collections::VecDeque;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Instant;

use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

use super::metrics::Metrics;
use crate::batch::{Batch, Row};
use crate::engine::{Engine, SampleParams};
use crate::tokenizer::Tokenizer;
use crate::vision::encode::ImagePrompt;
use crate::vision::prompt::Prompt;
use crate::vision::{Modality, Placeholders, SoftTokens};

/// One generation request, tokenized and checked.
#[derive(Clone, Debug)]
pub struct Request {
    pub prompt: Vec<u32>,
    /// Tokens to sample at most (a stop token included).
    pub max_tokens: usize,
    pub sampling: SampleParams,
    /// Strings that end the generation (not included in the text).
    pub stop: Vec<String>,
    /// Keep going past the checkpoint's stop tokens.
    pub ignore_eos: bool,
    /// Log-probabilities of each sampled token and of the `n` most likely ones.
    pub logprobs: Option<usize>,
    /// The soft tokens of the prompt's image and audio placeholder runs, each kind in order
    /// (none: a text prompt).
    pub soft: Vec<SoftTokens>,
}

/// Why a generation ended, in the API's words.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Finish {
    /// A stop token or stop string.
    Stop,
    /// `max_tokens`, or the context is full.
    Length,
}

impl Finish {
    pub fn as_str(self) -> &'static str {
        match self {
            Finish::Stop => "stop",
            Finish::Length => "length",
        }
    }
}

/// A token's log-probability, and the most likely alternatives at its position.
#[derive(Clone, Debug)]
pub struct TokenLogprob {
    pub token: String,
    pub logprob: f32,
    pub top: Vec<(String, f32)>,
}

/// What a request's channel carries.
#[derive(Debug)]
pub enum Event {
    /// A sampled token: the text it releases (empty while a character or a possible stop
    /// string is incomplete) and, when asked for, its log-probabilities.
    Token { text: String, logprob: Option<TokenLogprob> },
    Done { finish: Finish, usage: Usage },
    Error(String),
}

#[derive(Clone, Copy, Debug, Default)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    /// Prompt tokens whose keys and values were reused from a cached prefix.
    pub cached_tokens: usize,
}

/// Why a request was not queued.
#[derive(Debug, PartialEq, Eq)]
pub enum Refused {
    /// Every slot runs and the queue is full.
    Full,
    /// The server is shutting down.
    Draining,
}

struct Job {
    req: Request,
    tx: UnboundedSender<Event>,
    arrived: Instant,
}

struct Queue {
    waiting: VecDeque<Job>,
    /// Requests waiting or running.
    in_system: usize,
    draining: bool,
}

struct Shared {
    queue: Mutex<Queue>,
    wake: Condvar,
    capacity: usize,
    metrics: Arc<Metrics>,
}

/// The handle the HTTP side submits requests through.
#[derive(Clone)]
pub struct Scheduler {
    shared: Arc<Shared>,
}

impl Scheduler {
    /// Starts the engine thread with `parallel` slots and room for `max_queue` waiting requests.
    pub fn start(engine: Arc<Engine>, parallel: usize, max_queue: usize, metrics: Arc<Metrics>) -> Result<(Scheduler, std::thread::JoinHandle<()>), String> {
        let tokenizer_ok = engine.tokenizer().map(|_| ()).map_err(|e| e.to_string());
        tokenizer_ok?;
        let batch = Batch::new(&engine, parallel).map_err(|e| e.to_string())?;
        let slots = (0..parallel).map(|_| Slot { seq: None, marks: vec![] }).collect();
        metrics.kv_total.store((parallel * engine.max_context()) as u64, Relaxed);
        let shared = Arc::new(Shared {
            queue: Mutex::new(Queue { waiting: VecDeque::new(), in_system: 0, draining: false }),
            wake: Condvar::new(),
            capacity: parallel + max_queue,
            metrics,
        });
        let worker = Worker { engine, shared: shared.clone(), batch, slots, admitted: 0 };
        let handle = std::thread::Builder::new().name("markbase-engine".into()).spawn(move || worker.run()).map_err(|e| e.to_string())?;
        Ok((Scheduler { shared }, handle))
    }

    /// Queues a request; its events arrive on the returned channel. Dropping the receiver
    /// cancels the request (its slot is freed within one step).
    pub fn submit(&self, req: Request) -> Result<UnboundedReceiver<Event>, Refused> {
        let (tx, rx) = unbounded_channel();
        let mut q = self.shared.queue.lock().map_err(|_| Refused::Draining)?;
        if q.draining {
            return Err(Refused::Draining);
        }
        if q.in_system >= self.shared.capacity {
            return Err(Refused::Full);
        }
        q.in_system += 1;
        q.waiting.push_back(Job { req, tx, arrived: Instant::now() });
        self.shared.metrics.waiting.store(q.waiting.len() as u64, Relaxed);
        drop(q);
        self.shared.wake.notify_one();
        Ok(rx)
    }

    /// Stops taking requests; the engine thread ends once those accepted have finished.
    pub fn drain(&self) {
        if let Ok(mut q) = self.shared.queue.lock() {
            q.draining = true;
        }
        self.shared.wake.notify_all();
    }

    pub fn draining(&self) -> bool {
        self.shared.queue.lock().map_or(true, |q| q.draining)
    }
}

/// A sequence being generated in a slot.
struct Seq {
    job: Job,
    /// Admission order (prefill is first come, first served).
    order: u64,
    /// Prompt tokens in the slot's cache.
    fed: usize,
    cached: usize,
    /// The last sampled token, fed by the next decode step.
    next: Option<u32>,
    /// Sampled tokens that are part of the text (for incremental decoding).
    produced: Vec<u32>,
    sampled: usize,
    /// Decoded text not sent yet: it may be the start of a stop string.
    held: String,
    last_token: Option<Instant>,
    /// The prompt's soft tokens still to feed (a prompt with images or clips).
    soft: Option<SoftFeed>,
}

/// What is left to feed of a prompt with images or clips: its ids after the cached prefix,
/// their soft rows, and the prefill steps they are cut in (whole placeholder runs where they
/// attend to themselves).
struct SoftFeed {
    ids: Vec<u32>,
    prompt: ImagePrompt,
    steps: VecDeque<(usize, bool)>,
    /// Tokens of `ids` fed so far.
    at: usize,
}

struct Slot {
    seq: Option<Seq>,
    /// The positions of the slot's cached tokens that hold soft rows, with a hash of each row:
    /// a prefix is reused only where these agree too (placeholder ids are the same for
    /// every image).
    marks: Vec<(usize, u64)>,
}

/// What one sequence's step produced: its token and, for log-probabilities, the logits.
type Token = (u32, Option<Vec<f32>>);
type Sampled = Result<Token, String>;

struct Worker {
    engine: Arc<Engine>,
    shared: Arc<Shared>,
    /// The slots' caches and tokens.
    batch: Batch,
    slots: Vec<Slot>,
    admitted: u64,
}

impl Worker {
    fn run(mut self) {
        loop {
            let jobs = {
                let Ok(mut q) = self.shared.queue.lock() else { return };
                while self.running() == 0 && q.waiting.is_empty() {
                    if q.draining {
                        return;
                    }
                    q = match self.shared.wake.wait(q) {
                        Ok(q) => q,
                        Err(_) => return,
                    };
                }
                let free = self.slots.iter().filter(|s| s.seq.is_none()).count();
                let n = free.min(q.waiting.len());
                let jobs: Vec<Job> = q.waiting.drain(..n).collect();
                self.shared.metrics.waiting.store(q.waiting.len() as u64, Relaxed);
                jobs
            };
            for job in jobs {
                self.admit(job);
            }
            // a bug in a step fails the running requests, not the server
            if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.step())).is_err() {
                for i in 0..self.slots.len() {
                    if let Some(seq) = &self.slots[i].seq {
                        let _ = seq.job.tx.send(Event::Error("internal error in the scheduler step".into()));
                        self.batch.reset(i);
                        self.finish_slot(i, None);
                    }
                }
            }
        }
    }

    fn running(&self) -> usize {
        self.slots.iter().filter(|s| s.seq.is_some()).count()
    }

    /// Puts a job in the free slot whose cached tokens share the longest prefix with its prompt
    /// (soft rows included).
    fn admit(&mut self, job: Job) {
        let m = &self.shared.metrics;
        m.queue_time.observe(job.arrived.elapsed().as_secs_f64());
        let prompt = &job.req.prompt;
        let ph = self.engine.placeholders();
        let marks = soft_marks(prompt, &job.req.soft, &ph);
        let best = self
            .slots
            .iter()
            .enumerate()
            .filter(|(_, s)| s.seq.is_none())
            .map(|(i, s)| (reusable_prefix(self.batch.tokens(i), &s.marks, prompt, &marks, &ph), i))
            .max_by_key(|&(common, i)| (common, std::cmp::Reverse(i)));
        let Some((common, i)) = best else {
            // the caller admits no more jobs than there are free slots
            let _ = job.tx.send(Event::Error("no free sequence slot".into()));
            self.release(1);
            return;
        };
        // at least one prompt token is fed: the step that samples the first token; a
        // placeholder run is fed whole
        let keep = run_start(common.min(prompt.len().saturating_sub(1)), self.batch.tokens(i), prompt, &ph);
        let cached = if keep > 0 && self.batch.truncate(i, keep) {
            keep
        } else {
            self.batch.reset(i);
            0
        };
        self.slots[i].marks = marks;
        let soft = if job.req.soft.is_empty() {
            None
        } else {
            let full = Prompt { ids: prompt.clone(), soft: job.req.soft.clone() };
            let (_, tail) = full.tail(cached, &ph);
            match self.engine.plan(&tail.ids, &tail.soft) {
                Ok((Some(p), steps)) => Some(SoftFeed { ids: tail.ids, prompt: p, steps: steps.into(), at: 0 }),
                Ok((None, _)) => None,
                Err(e) => {
                    // (the HTTP side plans every prompt before it is queued)
                    let _ = job.tx.send(Event::Error(e.to_string()));
                    self.batch.reset(i);
                    self.release(1);
                    return;
                }
            }
        };
        m.prompt_tokens.fetch_add(prompt.len() as u64, Relaxed);
        m.cached_prompt_tokens.fetch_add(cached as u64, Relaxed);
        m.running.fetch_add(1, Relaxed);
        self.admitted += 1;
        let seq = Seq { job, order: self.admitted, fed: cached, cached, next: None, produced: vec![], sampled: 0, held: String::new(), last_token: None, soft };
        self.slots[i].seq = Some(seq);
    }

    /// One step: cancellations, one prefill chunk, one token of every decoding sequence.
    fn step(&mut self) {
        for i in 0..self.slots.len() {
            if self.slots[i].seq.as_ref().is_some_and(|s| s.job.tx.is_closed()) {
                self.finish_slot(i, None);
            }
        }
        let decoding: Vec<usize> = (0..self.slots.len()).filter(|&i| self.slots[i].seq.as_ref().is_some_and(|s| s.next.is_some())).collect();
        self.prefill();
        self.decode(&decoding);
        let m = &self.shared.metrics;
        m.steps.fetch_add(1, Relaxed);
        let used: usize = (0..self.slots.len()).filter(|&i| self.slots[i].seq.is_some()).map(|i| self.batch.position(i)).sum();
        m.kv_used.store(used as u64, Relaxed);
    }

    /// Feeds prompt pieces of the oldest prefilling sequences, one chunk of tokens in all (at
    /// least one piece). Pieces are whole chunks and the rest, as a lone prefill cuts them.
    fn prefill(&mut self) {
        let chunk = self.engine.prefill_chunk().max(1);
        let mut order: Vec<(u64, usize)> = self
            .slots
            .iter()
            .enumerate()
            .filter_map(|(i, s)| s.seq.as_ref().filter(|q| q.next.is_none() && q.fed < q.job.req.prompt.len()).map(|q| (q.order, i)))
            .collect();
        order.sort_unstable();
        let mut budget = chunk;
        for (_, i) in order {
            if budget == 0 {
                break;
            }
            let Some(seq) = self.slots[i].seq.as_mut() else { continue };
            let prompt = &seq.job.req.prompt;
            let (n, r) = match seq.soft.as_mut() {
                None => {
                    // whole chunks, then the rest (which the engine cuts in powers of two): the
                    // pieces a prompt fed at once is cut in
                    let n = (prompt.len() - seq.fed).min(chunk);
                    let last = seq.fed + n == prompt.len();
                    (n, feed_prompt(&mut self.batch, i, Piece::Text(&prompt[seq.fed..seq.fed + n]), last, &seq.job.req))
                }
                Some(f) => {
                    // the plan's steps (a chunk at most each), as many as a chunk holds
                    let mut steps = vec![];
                    let mut n = 0;
                    while let Some(&(k, rows)) = f.steps.front() {
                        if !steps.is_empty() && n + k > chunk {
                            break;
                        }
                        steps.push((k, rows));
                        n += k;
                        f.steps.pop_front();
                    }
                    let piece = Piece::Soft { ids: &f.ids, prompt: &f.prompt, start: f.at, steps: &steps };
                    f.at += n;
                    (n, feed_prompt(&mut self.batch, i, piece, f.steps.is_empty(), &seq.job.req))
                }
            };
            budget = budget.saturating_sub(n);
            let end = seq.fed + n;
            match r {
                Ok(out) => {
                    seq.fed = end;
                    if let Some(out) = out {
                        self.sampled(i, Ok(out));
                    }
                }
                Err(e) => self.sampled(i, Err(e)),
            }
        }
    }

    /// One batched decode step of the sequences in `idx`.
    fn decode(&mut self, idx: &[usize]) {
        let mut rows: Vec<Row> = Vec::with_capacity(idx.len());
        let mut logits = false;
        for &i in idx {
            let Some(seq) = self.slots[i].seq.as_ref() else { continue };
            let Some(token) = seq.next else { continue };
            logits |= seq.job.req.logprobs.is_some();
            rows.push(Row { slot: i, token, sampling: &seq.job.req.sampling, step: seq.sampled as u32 });
        }
        if rows.is_empty() {
            return;
        }
        let slots: Vec<usize> = rows.iter().map(|r| r.slot).collect();
        let results: Vec<(usize, Sampled)> = match self.batch.decode(&rows, logits) {
            Ok(out) => {
                let v = self.engine.config.vocab_size;
                slots
                    .iter()
                    .enumerate()
                    .map(|(r, &i)| {
                        let wants = self.slots[i].seq.as_ref().is_some_and(|s| s.job.req.logprobs.is_some());
                        let row = out.logits.as_ref().filter(|_| wants).and_then(|l| l.get(r * v..(r + 1) * v)).map(|l| l.to_vec());
                        (i, Ok((out.tokens[r], row)))
                    })
                    .collect()
            }
            Err(e) => slots.iter().map(|&i| (i, Err(e.to_string()))).collect(),
        };
        for (i, r) in results {
            self.sampled(i, r);
        }
    }

    /// Handles a sequence's sampled token: stop tokens and strings, text, limits.
    fn sampled(&mut self, i: usize, r: Sampled) {
        let (tok, logits) = match r {
            Ok(x) => x,
            Err(e) => {
                if let Some(seq) = &self.slots[i].seq {
                    let _ = seq.job.tx.send(Event::Error(e));
                }
                self.batch.reset(i);
                self.finish_slot(i, None);
                return;
            }
        };
        let tk = match self.engine.tokenizer() {
            Ok(t) => t,
            Err(e) => return self.sampled(i, Err(e.to_string())),
        };
        let max_context = self.engine.max_context();
        let m = &self.shared.metrics;
        let Some(seq) = self.slots[i].seq.as_mut() else { return };
        let now = Instant::now();
        match seq.last_token {
            None => m.ttft.observe((now - seq.job.arrived).as_secs_f64()),
            Some(t) => m.inter_token.observe((now - t).as_secs_f64()),
        }
        seq.last_token = Some(now);
        seq.sampled += 1;
        m.generated_tokens.fetch_add(1, Relaxed);
        let logprob = match (&logits, seq.job.req.logprobs) {
            (Some(l), Some(n)) => Some(token_logprob(tk, l, tok, n)),
            _ => None,
        };
        let mut finish = None;
        if !seq.job.req.ignore_eos && tk.stop_ids.contains(&tok) {
            finish = Some(Finish::Stop);
            let text = std::mem::take(&mut seq.held);
            let _ = seq.job.tx.send(Event::Token { text, logprob });
        } else {
            let piece = match tk.decode_incremental(&seq.produced, tok) {
                Ok(p) => p,
                Err(e) => return self.sampled(i, Err(e.to_string())),
            };
            seq.produced.push(tok);
            seq.held.push_str(&piece);
            let (text, stopped) = release(&mut seq.held, &seq.job.req.stop);
            if stopped {
                finish = Some(Finish::Stop);
            }
            let _ = seq.job.tx.send(Event::Token { text, logprob });
        }
        if finish.is_none() && (seq.sampled >= seq.job.req.max_tokens || self.batch.position(i) >= max_context) {
            finish = Some(Finish::Length);
        }
        match finish {
            Some(f) => self.finish_slot(i, Some(f)),
            None => {
                if let Some(seq) = self.slots[i].seq.as_mut() {
                    seq.next = Some(tok);
                }
            }
        }
    }

    /// Ends the sequence in slot `i` (`None`: cancelled or failed) and frees the slot; the
    /// slot's cache keeps its tokens for a later prompt with the same prefix.
    fn finish_slot(&mut self, i: usize, finish: Option<Finish>) {
        let Some(mut seq) = self.slots[i].seq.take() else { return };
        // the slot is free before the client hears of the end: its next request is admitted
        self.release(1);
        let m = &self.shared.metrics;
        m.running.fetch_sub(1, Relaxed);
        m.e2e.observe(seq.job.arrived.elapsed().as_secs_f64());
        match finish {
            Some(f) => {
                let text = std::mem::take(&mut seq.held);
                if !text.is_empty() {
                    let _ = seq.job.tx.send(Event::Token { text, logprob: None });
                }
                let usage = Usage { prompt_tokens: seq.job.req.prompt.len(), completion_tokens: seq.sampled, cached_tokens: seq.cached };
                let _ = seq.job.tx.send(Event::Done { finish: f, usage });
                m.finished(f.as_str());
            }
            None => m.finished(if seq.job.tx.is_closed() { "cancelled" } else { "error" }),
        }
    }

    fn release(&self, n: usize) {
        if let Ok(mut q) = self.shared.queue.lock() {
            q.in_system = q.in_system.saturating_sub(n);
        }
    }
}

/// A piece of a prompt: text tokens, or steps of a prompt with soft rows.
enum Piece<'a> {
    Text(&'a [u32]),
    Soft { ids: &'a [u32], prompt: &'a ImagePrompt, start: usize, steps: &'a [(usize, bool)] },
}

/// Feeds a piece of a prompt into slot `slot`; the last piece samples the first token (at
/// sampler step 0), with the last position's logits where asked for.
fn feed_prompt(b: &mut Batch, slot: usize, piece: Piece, last: bool, req: &Request) -> Result<Option<Token>, String> {
    let sampling = last.then_some((&req.sampling, 0));
    let logits = last && req.logprobs.is_some();
    let out = match piece {
        Piece::Text(ids) => b.prefill(slot, ids, logits, sampling),
        Piece::Soft { ids, prompt, start, steps } => b.prefill_soft(slot, ids, prompt, start, steps, logits, sampling),
    }
    .map_err(|e| e.to_string())?;
    Ok(last.then_some((out.token, out.logits)))
}

fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// The positions of `ids` that take soft rows, each with a hash of its row (and kind).
fn soft_marks(ids: &[u32], soft: &[SoftTokens], ph: &Placeholders) -> Vec<(usize, u64)> {
    use std::hash::{Hash, Hasher};
    let mut marks = vec![];
    for kind in [Modality::Image, Modality::Audio] {
        let Some(id) = ph.id(kind) else { continue };
        let rows = soft.iter().filter(|s| s.kind == kind).flat_map(|s| s.data.chunks(s.width.max(1)));
        let at = ids.iter().enumerate().filter(|&(_, &t)| t == id).map(|(p, _)| p);
        for (p, row) in at.zip(rows) {
            let mut h = std::collections::hash_map::DefaultHasher::new();
            (kind as u8).hash(&mut h);
            for x in row {
                x.to_bits().hash(&mut h);
            }
            marks.push((p, h.finish()));
        }
    }
    marks.sort_unstable();
    marks
}

/// How many of the `cached` tokens (with soft-row marks `cached_marks`) a prompt of `ids`
/// (marks `marks`) can reuse: the common prefix, up to the first position where only one of
/// them has a soft row or their rows differ.
fn reusable_prefix(cached: &[u32], cached_marks: &[(usize, u64)], ids: &[u32], marks: &[(usize, u64)], ph: &Placeholders) -> usize {
    let common = common_prefix(cached, ids);
    let (mut a, mut b) = (cached_marks.iter().peekable(), marks.iter().peekable());
    let mut agree = common;
    loop {
        match (a.peek(), b.peek()) {
            (Some(&&x), Some(&&y)) if x == y => {
                a.next();
                b.next();
            }
            (Some(&&(p, _)), Some(&&(q, _))) => {
                agree = p.min(q);
                break;
            }
            (Some(&&(p, _)), None) | (None, Some(&&(p, _))) => {
                agree = p;
                break;
            }
            (None, None) => break,
        }
    }
    run_start(common.min(agree), cached, ids, ph)
}

/// `keep`, or the start of the placeholder run that `keep` would cut in `cached` or in `ids`
/// (which agree before `keep`): a run's rows are fed in one step, those of a run that attends
/// to itself depending on all of it.
fn run_start(mut keep: usize, cached: &[u32], ids: &[u32], ph: &Placeholders) -> usize {
    let continues = |s: &[u32], k: usize| k < s.len() && s[k] == s[k - 1];
    while keep > 0 && ph.holds(ids[keep - 1]) && (continues(cached, keep) || continues(ids, keep)) {
        keep -= 1;
    }
    keep
}

/// Takes from `held` the text that can be sent: all of it up to a stop string (then true),
/// else all but a tail that could begin a stop string.
pub fn release(held: &mut String, stops: &[String]) -> (String, bool) {
    let stops = stops.iter().filter(|s| !s.is_empty());
    if let Some(at) = stops.clone().filter_map(|s| held.find(s.as_str())).min() {
        let out = held[..at].to_string();
        held.clear();
        return (out, true);
    }
    // the longest suffix of `held` that is a proper prefix of a stop string
    let keep = stops
        .flat_map(|s| (1..s.len()).rev().filter(|&k| s.is_char_boundary(k) && held.ends_with(&s[..k])).take(1))
        .max()
        .unwrap_or(0);
    let cut = held.len() - keep;
    let rest = held.split_off(cut);
    (std::mem::replace(held, rest), false)
}

/// The log-probability of `tok` under the softmax of `logits` (one position's row: steps that
/// report log-probabilities feed one token), and the `n` most likely tokens.
fn token_logprob(tk: &Tokenizer, logits: &[f32], tok: u32, n: usize) -> TokenLogprob {
    let row = logits;
    let max = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    let lse = max + row.iter().map(|&x| ((x - max) as f64).exp()).sum::<f64>().ln() as f32;
    let text = |id: u32| tk.decode(&[id]).unwrap_or_default();
    let mut idx: Vec<u32> = (0..row.len() as u32).collect();
    let n = n.min(row.len());
    if n > 0 {
        idx.select_nth_unstable_by(n - 1, |&a, &b| row[b as usize].total_cmp(&row[a as usize]));
    }
    let mut top: Vec<u32> = idx[..n].to_vec();
    top.sort_by(|&a, &b| row[b as usize].total_cmp(&row[a as usize]));
    TokenLogprob {
        token: text(tok),
        logprob: row.get(tok as usize).map_or(f32::NEG_INFINITY, |&x| x - lse),
        top: top.into_iter().map(|id| (text(id), row[id as usize] - lse)).collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stop_strings_hold_back_what_may_start_them() {
        let stops = vec!["</s>".to_string(), "END".to_string()];
        let mut held = "hello <".to_string();
        assert_eq!(release(&mut held, &stops), ("hello ".to_string(), false));
        assert_eq!(held, "<");
        held.push_str("/x");
        assert_eq!(release(&mut held, &stops), ("</x".to_string(), false));
        held.push_str("abc EN");
        assert_eq!(release(&mut held, &stops), ("abc ".to_string(), false));
        held.push_str("D more");
        assert_eq!(release(&mut held, &stops), ("".to_string(), true));
        let mut held = "no stops".to_string();
        assert_eq!(release(&mut held, &[]), ("no stops".to_string(), false));
        let mut held = "é".to_string();
        assert_eq!(release(&mut held, &["éa".to_string()]), ("".to_string(), false));
    }
}
