//! Compiles kernels/*.cu to sm_90a cubins with nvcc and embeds them. nvcc is found through
//! $NVCC, $CUDA_HOME/bin/nvcc, the PATH, or the PyPI toolkit in <workspace>/.cuda-toolkit
//! (see docs in README). Without nvcc the crate still builds, and the backend reports at run time
//! that this build carries no kernels. A kernel that does not compile fails the build.

use std::path::{Path, PathBuf};
use std::process::Command;

const KERNELS: [&str; 12] = [
    "gemv",
    "moe",
    "gdn",
    "attention",
    "sample",
    "gemm",
    "route",
    "act",
    "gdn_prefill",
    "attention_prefill",
    "ceiling",
    "speculative",
];

fn find_nvcc(workspace: &Path) -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("NVCC") {
        return Some(PathBuf::from(p));
    }
    if let Some(home) = std::env::var_os("CUDA_HOME") {
        let p = PathBuf::from(home).join("bin/nvcc");
        if p.exists() {
            return Some(p);
        }
    }
    if let Some(path) = std::env::var_os("PATH") {
        for dir in std::env::split_paths(&path) {
            let p = dir.join("nvcc");
            if p.exists() {
                return Some(p);
            }
        }
    }
    let lib = workspace.join(".cuda-toolkit/lib");
    std::fs::read_dir(&lib)
        .ok()?
        .filter_map(|e| e.ok())
        .map(|e| e.path().join("site-packages/nvidia/cu13/bin/nvcc"))
        .find(|p| p.exists())
}

fn main() {
    let manifest = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("manifest dir"));
    let workspace = manifest.join("../..");
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("out dir"));
    println!("cargo:rerun-if-env-changed=NVCC");
    println!("cargo:rerun-if-env-changed=CUDA_HOME");
    println!("cargo:rustc-check-cfg=cfg(osprey_kernels)");
    println!("cargo:rerun-if-changed=kernels/common.cuh");
    println!("cargo:rerun-if-changed=kernels/tiles.cuh");
    println!("cargo:rerun-if-changed=kernels/wgmma.cuh");
    for k in KERNELS {
        println!("cargo:rerun-if-changed=kernels/{k}.cu");
    }
    let Some(nvcc) = find_nvcc(&workspace) else {
        println!("cargo:warning=nvcc not found: building the CUDA backend without kernels (set NVCC or CUDA_HOME)");
        return;
    };
    for k in KERNELS {
        let src = manifest.join(format!("kernels/{k}.cu"));
        let dst = out.join(format!("{k}.cubin"));
        let status = Command::new(&nvcc)
            .args([
                "-gencode=arch=compute_90a,code=sm_90a",
                "-cubin",
                "-O3",
                "-lineinfo",
                "-std=c++17",
                "-o",
            ])
            .arg(&dst)
            .arg(&src)
            .status()
            .unwrap_or_else(|e| panic!("cannot run {}: {e}", nvcc.display()));
        assert!(status.success(), "nvcc failed on {}", src.display());
    }
    println!("cargo:rustc-cfg=osprey_kernels");
}
