//! Records the commit the binary is built from, so that `osprey --version` and every benchmark or
//! check report name the code that ran, wherever the binary is carried (the GPU machine's copy of
//! the tree may be at another commit, or have no history at all). `+dirty` marks a build with
//! uncommitted changes to the code; `unknown` a build outside a git checkout.

use std::path::{Path, PathBuf};
use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

fn main() {
    let manifest = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").unwrap_or_default());
    let workspace = manifest
        .parent()
        .and_then(Path::parent)
        .map(Path::to_path_buf)
        .unwrap_or_default();
    let workspace_dir = workspace.display().to_string();

    let commit = match git(&["-C", &workspace_dir, "rev-parse", "--short", "HEAD"]) {
        Some(commit) => {
            let clean = Command::new("git")
                .args(["-C", &workspace_dir, "diff", "--quiet", "HEAD", "--"])
                .args(["crates", "Cargo.toml", "Cargo.lock"])
                .status()
                .map(|s| s.success())
                .unwrap_or(true);
            if clean {
                commit
            } else {
                format!("{commit}+dirty")
            }
        }
        None => "unknown".to_string(),
    };
    println!("cargo:rustc-env=OSPREY_BUILD_COMMIT={commit}");

    // Run again when HEAD moves (a checkout, a commit) or the code changes.
    if let Some(git_dir) = git(&["-C", &workspace_dir, "rev-parse", "--absolute-git-dir"]) {
        let git_dir = PathBuf::from(git_dir);
        println!("cargo:rerun-if-changed={}", git_dir.join("HEAD").display());
        println!("cargo:rerun-if-changed={}", git_dir.join("index").display());
        let head_ref = git(&["-C", &workspace_dir, "symbolic-ref", "-q", "HEAD"]);
        // A path that does not exist would make cargo run this script on every build.
        let watched = head_ref
            .map(|r| git_dir.join(r))
            .into_iter()
            .chain([git_dir.join("packed-refs")]);
        for path in watched.filter(|p| p.exists()) {
            println!("cargo:rerun-if-changed={}", path.display());
        }
    }
    for path in ["crates", "Cargo.toml", "Cargo.lock"] {
        println!("cargo:rerun-if-changed={}", workspace.join(path).display());
    }
}
