//! Safetensors files of a checkpoint directory, memory-mapped: a single `model.safetensors`, the
//! shards named by `model.safetensors.index.json`, or every `*.safetensors` file in the directory.
//! Headers are validated (offsets inside the file, sizes matching dtype × shape) before any tensor
//! is used, so a truncated or corrupt file is an error naming the file, never a crash.

use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};

use crate::config::canonical_name;

/// Where one tensor lives.
#[derive(Clone, Debug)]
pub struct TensorEntry {
    /// Name as written in the file.
    pub file_name: String,
    pub file: usize,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    /// Byte offset of the data inside the mapped file.
    pub start: usize,
    pub byte_len: usize,
}

/// All tensors of a checkpoint, by canonical name (see [`canonical_name`]).
pub struct Checkpoint {
    pub dir: PathBuf,
    pub files: Vec<PathBuf>,
    pub maps: Vec<Arc<Mmap>>,
    pub tensors: BTreeMap<String, TensorEntry>,
}

/// Tensors of other modalities that text inference does not use.
fn ignored(canonical: &str) -> bool {
    canonical.starts_with("vision_tower") || canonical.starts_with("model.visual")
}

impl Checkpoint {
    pub fn open(dir: &Path) -> Result<Self> {
        let files = safetensors_files(dir)?;
        let mut maps = Vec::with_capacity(files.len());
        let mut tensors = BTreeMap::new();
        for (fi, path) in files.iter().enumerate() {
            let file =
                File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
            // SAFETY: the map is read-only; the checkpoint must not be modified while loaded,
            // as for every memory-mapped model loader.
            let map = unsafe { Mmap::map(&file) }
                .with_context(|| format!("cannot memory-map {}", path.display()))?;
            let st = SafeTensors::deserialize(&map).map_err(|e| {
                anyhow::anyhow!(
                    "{} is not a valid safetensors file (truncated or corrupt?): {e}",
                    path.display()
                )
            })?;
            let base = map.as_ptr() as usize;
            for (name, view) in st.tensors() {
                let canonical = canonical_name(&name);
                if ignored(&canonical) {
                    continue;
                }
                let entry = TensorEntry {
                    file_name: name.clone(),
                    file: fi,
                    dtype: view.dtype(),
                    shape: view.shape().to_vec(),
                    start: view.data().as_ptr() as usize - base,
                    byte_len: view.data().len(),
                };
                if let Some(prev) = tensors.insert(canonical.clone(), entry) {
                    bail!(
                        "tensor {canonical} appears twice (as {} in {} and as {name} in {})",
                        prev.file_name,
                        files[prev.file].display(),
                        path.display()
                    );
                }
            }
            maps.push(Arc::new(map));
        }
        Ok(Checkpoint {
            dir: dir.to_path_buf(),
            files,
            maps,
            tensors,
        })
    }

    pub fn get(&self, name: &str) -> Option<&TensorEntry> {
        self.tensors.get(name)
    }

    pub fn total_bytes(&self) -> usize {
        self.tensors.values().map(|t| t.byte_len).sum()
    }
}

fn safetensors_files(dir: &Path) -> Result<Vec<PathBuf>> {
    if !dir.is_dir() {
        bail!("model directory {} does not exist", dir.display());
    }
    let index = dir.join("model.safetensors.index.json");
    if index.exists() {
        let text = std::fs::read_to_string(&index)
            .with_context(|| format!("cannot read {}", index.display()))?;
        let v: serde_json::Value = serde_json::from_str(&text)
            .with_context(|| format!("{} is not valid JSON", index.display()))?;
        let map = v
            .get("weight_map")
            .and_then(|m| m.as_object())
            .with_context(|| format!("{}: \"weight_map\" is missing", index.display()))?;
        let mut names = BTreeSet::new();
        for (tensor, file) in map {
            let f = file.as_str().with_context(|| {
                format!(
                    "{}: weight_map entry for {tensor} is not a file name",
                    index.display()
                )
            })?;
            if f.contains('/') || f.contains("..") {
                bail!(
                    "{}: weight_map names a file outside the directory: {f}",
                    index.display()
                );
            }
            names.insert(f.to_string());
        }
        let files: Vec<PathBuf> = names.into_iter().map(|n| dir.join(n)).collect();
        let missing: Vec<String> = files
            .iter()
            .filter(|p| !p.exists())
            .map(|p| p.display().to_string())
            .collect();
        if !missing.is_empty() {
            bail!(
                "shards named in {} are missing: {}",
                index.display(),
                missing.join(", ")
            );
        }
        return Ok(files);
    }
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .with_context(|| format!("cannot list {}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    files.sort();
    if files.is_empty() {
        bail!("no .safetensors files in {}", dir.display());
    }
    Ok(files)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::synth::{write_checkpoint, Preset, SynthOptions};
    use crate::weights::ModelWeights;

    /// Rewrites a single-file checkpoint as two shards plus model.safetensors.index.json.
    fn shard(dir: &Path) {
        let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let mut names: Vec<String> = st.names().into_iter().map(String::from).collect();
        names.sort();
        let (a, b) = names.split_at(names.len() / 2);
        let mut weight_map = serde_json::Map::new();
        for (i, part) in [a, b].iter().enumerate() {
            let file = format!("model-{:05}-of-00002.safetensors", i + 1);
            let views: Vec<(String, safetensors::tensor::TensorView)> = part
                .iter()
                .map(|n| (n.clone(), st.tensor(n).unwrap()))
                .collect();
            safetensors::serialize_to_file(views, None, &dir.join(&file)).unwrap();
            for n in part.iter() {
                weight_map.insert(n.clone(), file.clone().into());
            }
        }
        let index =
            serde_json::json!({"metadata": {"total_size": bytes.len()}, "weight_map": weight_map});
        std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
        std::fs::remove_file(dir.join("model.safetensors")).unwrap();
    }

    #[test]
    fn sharded_checkpoint_loads_like_the_single_file() {
        let single = tempfile::tempdir().unwrap();
        let sharded = tempfile::tempdir().unwrap();
        let opts = SynthOptions {
            preset: Preset::Tiny,
            layers: Some(4),
            seed: 4,
            show_progress: false,
            mtp: false,
        };
        write_checkpoint(single.path(), &opts).unwrap();
        write_checkpoint(sharded.path(), &opts).unwrap();
        shard(sharded.path());
        let ck = Checkpoint::open(sharded.path()).unwrap();
        assert_eq!(ck.files.len(), 2);
        let (a, b) = (
            ModelWeights::load(single.path()).unwrap(),
            ModelWeights::load(sharded.path()).unwrap(),
        );
        let (mut ra, mut rb) = (
            vec![0.0; a.config.hidden_size],
            vec![0.0; b.config.hidden_size],
        );
        for r in [0usize, 17, 248_000] {
            a.embed_tokens.dequantize_row(r, &mut ra);
            b.embed_tokens.dequantize_row(r, &mut rb);
            assert_eq!(ra, rb);
        }
        a.layers[3].moe.experts[5].down.dequantize_row(7, &mut ra);
        b.layers[3].moe.experts[5].down.dequantize_row(7, &mut rb);
        assert_eq!(ra, rb);
    }

    #[test]
    fn missing_shard_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let opts = SynthOptions {
            preset: Preset::Tiny,
            layers: Some(1),
            seed: 4,
            show_progress: false,
            mtp: false,
        };
        write_checkpoint(dir.path(), &opts).unwrap();
        shard(dir.path());
        std::fs::remove_file(dir.path().join("model-00002-of-00002.safetensors")).unwrap();
        let err = Checkpoint::open(dir.path()).err().unwrap().to_string();
        assert!(err.contains("model-00002-of-00002.safetensors"), "{err}");
    }
}
