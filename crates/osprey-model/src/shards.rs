//! Writes a checkpoint's tensors as MLX does: safetensors shards of ~5 GB
//! (`model-0000i-of-0000n.safetensors`, or one `model.safetensors`), each with `{"format": "mlx"}`
//! metadata, and `model.safetensors.index.json` naming each tensor's shard. Tensors are streamed:
//! the header is written from the planned shapes, then each tensor's bytes in order.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

use anyhow::{Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::{json, Value};

const SHARD_BYTES: usize = 5_000_000_000;

/// One tensor to write: its name, safetensors dtype ("U32", "BF16", "F32") and shape.
pub struct ShardTensor {
    pub name: String,
    pub dtype: &'static str,
    pub shape: Vec<usize>,
}

impl ShardTensor {
    pub fn bytes(&self) -> usize {
        let elem = match self.dtype {
            "U32" | "F32" => 4,
            _ => 2,
        };
        self.shape.iter().product::<usize>() * elem
    }
}

/// A progress bar over `total` bytes labelled `what` (hidden unless `show`).
pub fn bytes_progress(total: u64, show: bool, what: &str) -> Result<ProgressBar> {
    let bar = if show {
        ProgressBar::new(total)
    } else {
        ProgressBar::hidden()
    };
    bar.set_style(
        ProgressStyle::with_template(&format!(
            "{what} [{{bar:40}}] {{bytes}}/{{total_bytes}} {{bytes_per_sec}} eta {{eta}}"
        ))
        .map_err(|e| anyhow::anyhow!("progress template: {e}"))?,
    );
    Ok(bar)
}

/// Writes `tensors` into shards of at most ~5 GB in the given order (with `codes_first`, each
/// shard's U32 tensors first, so that every code tensor starts 4-byte aligned and loads without a
/// copy). `fill(i, w)` must write exactly `tensors[i].bytes()` bytes. Returns the bytes written.
pub fn write_shards(
    out: &Path,
    tensors: &[ShardTensor],
    codes_first: bool,
    mut fill: impl FnMut(usize, &mut dyn Write) -> Result<()>,
) -> Result<u64> {
    let mut shards: Vec<Vec<usize>> = vec![Vec::new()];
    let mut size = 0;
    for (i, t) in tensors.iter().enumerate() {
        if size + t.bytes() > SHARD_BYTES && !shards.last().is_some_and(|s| s.is_empty()) {
            shards.push(Vec::new());
            size = 0;
        }
        size += t.bytes();
        if let Some(s) = shards.last_mut() {
            s.push(i)
        }
    }
    if codes_first {
        for s in &mut shards {
            s.sort_by_key(|&i| tensors[i].dtype != "U32");
        }
    }
    let n = shards.len();
    let mut weight_map = BTreeMap::new();
    let mut total = 0u64;
    for (si, shard) in shards.iter().enumerate() {
        let file_name = if n == 1 {
            "model.safetensors".to_string()
        } else {
            format!("model-{:05}-of-{:05}.safetensors", si + 1, n)
        };
        let mut header = serde_json::Map::new();
        header.insert("__metadata__".into(), json!({"format": "mlx"}));
        let mut offset = 0;
        for &i in shard {
            let t = &tensors[i];
            header.insert(
                t.name.clone(),
                json!({"dtype": t.dtype, "shape": t.shape, "data_offsets": [offset, offset + t.bytes()]}),
            );
            offset += t.bytes();
            weight_map.insert(t.name.clone(), file_name.clone());
        }
        let mut header = serde_json::to_vec(&Value::Object(header))?;
        while (8 + header.len()) % 8 != 0 {
            header.push(b' ');
        }
        let path = out.join(&file_name);
        let mut w = BufWriter::with_capacity(
            1 << 22,
            File::create(&path).with_context(|| format!("cannot create {}", path.display()))?,
        );
        w.write_all(&(header.len() as u64).to_le_bytes())?;
        w.write_all(&header)?;
        for &i in shard {
            let mut counted = Counted {
                inner: &mut w,
                bytes: 0,
            };
            fill(i, &mut counted)?;
            anyhow::ensure!(
                counted.bytes == tensors[i].bytes(),
                "{}: wrote {} bytes, planned {}",
                tensors[i].name,
                counted.bytes,
                tensors[i].bytes()
            );
        }
        w.flush()
            .with_context(|| format!("cannot write {}", path.display()))?;
        total += offset as u64;
    }
    if n > 1 {
        let index = json!({"metadata": {"total_size": total}, "weight_map": weight_map});
        std::fs::write(
            out.join("model.safetensors.index.json"),
            serde_json::to_vec_pretty(&index)?,
        )?;
    }
    Ok(total)
}

/// A writer that counts what goes through it (a tensor's bytes must match its planned size).
struct Counted<'a, W: Write> {
    inner: &'a mut W,
    bytes: usize,
}

impl<W: Write> Write for Counted<'_, W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.bytes += n;
        Ok(n)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}
