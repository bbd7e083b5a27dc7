//! `picchio` with `nvme-tcp://` stores, the real binary against picchio-nvme's in-process NVMe/TCP
//! target *model* on a loopback socket: `pack --out nvme-tcp://…`, then `run --store nvme-tcp://…`
//! gives the file tier's tokens, `verify` and `bench qd-sweep` read it, `nvme discover` lists the
//! subsystem, and a URI without a port or NQN is a usage error.
#![cfg(target_os = "linux")]

mod common;

use common::{assert_packed_image, image, model, ok, picchio, scratch};
use picchio_nvme::tcp::model::{ModelConfig, TargetModel};
use serde_json::Value;

const PROMPT: &str = "1,2,3,4,5";

fn run_tokens(store: &str) -> Vec<u64> {
    let m = model();
    let out =
        ok(&["run", "--model", m.to_str().unwrap(), "--prompt-ids", PROMPT, "-n", "8", "--json", "--store", store]);
    let v: Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(v["stats"]["fallbacks"], 0, "{v}");
    v["tokens"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap()).collect()
}

#[test]
fn pack_run_verify_bench_and_discover_over_nvme_tcp() {
    let dir = scratch();
    let ns = dir.path().join("ns1");
    std::fs::write(&ns, vec![0u8; 4 << 20]).unwrap();
    let t = TargetModel::start(ModelConfig::file(&ns, 4096)).unwrap();
    let uri = t.uri();
    let m = model();
    let out = ok(&["pack", m.to_str().unwrap(), "--out", &uri, "--no-progress"]);
    assert!(out.contains("payload hashes OK"), "{out}");
    let img = std::fs::read(m.join("experts.picchioflat")).unwrap();
    assert_packed_image(&std::fs::read(&ns).unwrap(), &img, &m);
    assert_eq!(run_tokens(&uri), run_tokens(&image()), "nvme-tcp:// gives the file tier's tokens");
    let out = ok(&["verify", &uri, "--model", m.to_str().unwrap(), "--no-progress"]);
    assert!(out.contains("OK") || out.contains("ok"), "{out}");
    let out = ok(&["nvme", "discover", &t.addr()]);
    assert!(out.contains(t.subnqn()) && out.contains(&format!("--store {}", uri.trim_end_matches("/1"))), "{out}");
    let json = dir.path().join("qd.json");
    ok(&["bench", "qd-sweep", "--store", &uri, "--qd", "1,4", "--duration", "0.2", "--json", json.to_str().unwrap()]);
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert!(v.to_string().contains("nvme-tcp"), "{v}");
}

#[test]
fn a_uri_without_port_or_nqn_is_a_usage_error_for_every_command() {
    let m = model();
    let m = m.to_str().unwrap();
    for store in ["nvme-tcp://127.0.0.1/nqn.2026-12.io.picchio:x", "nvme-tcp://127.0.0.1:4420"] {
        for args in [
            vec!["run", "--model", m, "--prompt-ids", "1", "-n", "1", "--store", store],
            vec!["pack", m, "--out", store, "--no-progress"],
            vec!["verify", store],
        ] {
            let o = picchio(&args);
            let err = String::from_utf8_lossy(&o.stderr);
            assert_ne!(o.status.code(), Some(0), "{args:?}");
            assert!(err.contains("needs a port") || err.contains("needs the subsystem NQN"), "{args:?}: {err}");
        }
    }
}

#[test]
fn a_refused_connection_names_the_address_and_step() {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    drop(l);
    let m = model();
    let store = format!("nvme-tcp://{addr}/nqn.2026-12.io.picchio:x");
    let o = picchio(&["run", "--model", m.to_str().unwrap(), "--prompt-ids", "1", "-n", "1", "--store", &store]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains(&addr) && err.contains("TCP connect"), "{err}");
}
