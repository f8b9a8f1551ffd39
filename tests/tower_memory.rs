//! The memory check before loading counts the vision and audio towers: their weights and the
//! buffers of a run over their largest input. A checkpoint whose towers cannot fit is refused,
//! naming them, before any weight is read.

use std::path::{Path, PathBuf};

use markbase::memory::{Needs, TowerNeeds};
use markbase::model::{DeviceKind, Model, ModelOptions};

const GEMMA4: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/vlm/gemma4");

/// A copy of the tiny Gemma 4 vision + audio fixture with its `config.json` edited.
fn fixture_copy(name: &str, edit: impl Fn(&mut serde_json::Value)) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("markbase-tower-memory-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    for e in std::fs::read_dir(GEMMA4).unwrap() {
        let e = e.unwrap();
        if e.path().is_file() {
            std::fs::copy(e.path(), dir.join(e.file_name())).unwrap();
        }
    }
    let mut cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    edit(&mut cfg);
    std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
    dir
}

fn load(dir: &Path, device: DeviceKind) -> Result<Model, markbase::Error> {
    Model::load(dir, ModelOptions { device, max_context: 64, prefill_chunk: 16, ..Default::default() })
}

#[test]
fn towers_that_cannot_fit_are_refused_before_loading() {
    // the fixture as it is loads on both devices
    let ok = fixture_copy("ok", |_| {});
    for device in [DeviceKind::Cpu, DeviceKind::Gpu(Some(markbase::gpu::device::Backend::Vulkan))] {
        assert!(load(&ok, device).is_ok(), "{device:?}: {:?}", load(&ok, device).err());
    }
    // towers of width 8M: tens of GiB of weights, and (vision) 10080 patches x 8M floats a
    // buffer, about 2 TiB of buffers
    let wide_vision = fixture_copy("vision", |c| c["vision_config"]["hidden_size"] = serde_json::json!(1 << 23));
    let wide_audio = fixture_copy("audio", |c| c["audio_config"]["hidden_size"] = serde_json::json!(1 << 23));
    for (dir, tower) in [(&wide_vision, "gemma4 ViT vision tower at 10080 patches"), (&wide_audio, "audio tower at a 30 s clip")] {
        let t = std::time::Instant::now();
        let e = load(dir, DeviceKind::Cpu).err().expect("a tower of petabytes loaded").to_string();
        assert!(e.contains(tower) && e.contains("need more than") && e.contains("the towers alone need"), "{e}");
        // refused from the config and the tensors' headers: no weight is read
        assert!(t.elapsed().as_secs_f64() < 5.0, "{:?}", t.elapsed());
        // a GPU: the tower's largest buffer is over the adapter's binding limit
        let e = load(dir, DeviceKind::Gpu(Some(markbase::gpu::device::Backend::Vulkan))).err().expect("a tower of petabytes loaded").to_string();
        assert!(e.contains(tower) && e.contains("limit"), "{e}");
    }
    // `markbase encode`'s encoders check the same before reading a weight
    use markbase::audio::encode::AudioEncoder;
    use markbase::vision::encode::ImageEncoder;
    for device in [DeviceKind::Cpu, DeviceKind::Gpu(Some(markbase::gpu::device::Backend::Vulkan))] {
        assert!(ImageEncoder::open(&ok, device, None, false).is_ok() && AudioEncoder::open(&ok, device, false).is_ok(), "{device:?}");
        let e = ImageEncoder::open(&wide_vision, device, None, false).err().expect("a vision tower of petabytes opened").to_string();
        assert!(e.contains("gemma4 ViT vision tower at 10080 patches") && (e.contains("need more than") || e.contains("limit")), "{device:?}: {e}");
        let e = AudioEncoder::open(&wide_audio, device, false).err().expect("an audio tower of petabytes opened").to_string();
        assert!(e.contains("audio tower at a 30 s clip") && (e.contains("need more than") || e.contains("limit")), "{device:?}: {e}");
    }
    for d in [ok, wide_vision, wide_audio] {
        let _ = std::fs::remove_dir_all(d);
    }
}

#[test]
fn tower_needs_add_up_and_name_the_tower() {
    let text = Needs { kv_bytes: 1 << 30, largest_kv: 1 << 26, kv_rows: vec![(4096, 1 << 14)], largest_pool: 1 << 20, pool_bytes: 1 << 24, towers: vec![] };
    let tower = TowerNeeds { name: "the SigLIP vision tower at 4096 patches".into(), weight_bytes: 800 << 20, largest_pool: 70 << 20, pool_bytes: 600 << 20 };
    let both = Needs { towers: vec![tower.clone()], ..text.clone() };
    let gib = 1u64 << 30;
    // the text alone fits 1.5 GiB, with the tower it does not
    assert!(text.fit_memory(Some(gib + gib / 2)).is_ok());
    let e = both.fit_memory(Some(gib + gib / 2)).unwrap_err();
    assert!(e.contains("and the SigLIP vision tower at 4096 patches (weights 800 MiB, buffers 600 MiB)") && e.contains("1.5 GiB of memory available"), "{e}");
    assert!(e.contains("lower --max-context (the towers need 1.4 GiB of it)"), "{e}");
    // towers over the memory on their own
    assert!(both.fit_memory(Some(gib)).unwrap_err().contains("the towers alone need 1.4 GiB"));
    assert!(both.fit_memory(Some(3 * gib)).is_ok());
    // the tower's largest buffer against the adapter's limits
    let limits = wgpu::Limits { max_storage_buffer_binding_size: 64 << 20, max_buffer_size: 1 << 30, ..Default::default() };
    assert!(text.fit_gpu("some adapter", &limits, 64 << 20, false).is_ok());
    let e = both.fit_gpu("some adapter", &limits, 64 << 20, false).unwrap_err();
    assert!(e.contains("the SigLIP vision tower at 4096 patches: an intermediate buffer needs 70 MiB") && e.contains("64 MiB storage binding limit"), "{e}");
}
