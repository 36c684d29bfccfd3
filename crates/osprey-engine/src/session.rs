//! Per-conversation state: the KV cache of every attention layer, the conv and recurrent state of
//! every Gated DeltaNet layer, and the position. Later tokens extend it (multi-turn); a snapshot is
//! a copy that can be restored to branch from that point (the GDN state cannot be rewound).

use osprey_model::config::{LayerKind, ModelConfig};

#[derive(Clone, Debug)]
pub enum LayerCache {
    GatedDeltaNet {
        /// The last `K-1` pre-conv `q|k|v` rows, oldest first: `[(K-1), conv_dim]`.
        conv: Vec<f32>,
        /// fp32 recurrent state `[Hv, Dk, Dv]`.
        recurrent: Vec<f32>,
    },
    Attention {
        /// Post-norm, post-RoPE keys `[positions, Hkv, D]`.
        k: Vec<f32>,
        /// Values `[positions, Hkv, D]`.
        v: Vec<f32>,
    },
}

#[derive(Clone, Debug)]
pub struct SessionState {
    pub layers: Vec<LayerCache>,
    /// Number of tokens already processed.
    pub position: usize,
}

impl SessionState {
    pub fn new(c: &ModelConfig) -> Self {
        let layers = c
            .layers
            .iter()
            .map(|kind| match kind {
                LayerKind::GatedDeltaNet => LayerCache::GatedDeltaNet {
                    conv: vec![0.0; (c.conv_kernel - 1) * c.conv_dim()],
                    recurrent: vec![
                        0.0;
                        c.linear_num_value_heads
                            * c.linear_key_head_dim
                            * c.linear_value_head_dim
                    ],
                },
                LayerKind::Attention => LayerCache::Attention {
                    k: Vec::new(),
                    v: Vec::new(),
                },
            })
            .collect();
        SessionState {
            layers,
            position: 0,
        }
    }

    /// Bytes held by the state.
    pub fn bytes(&self) -> usize {
        self.layers
            .iter()
            .map(|l| match l {
                LayerCache::GatedDeltaNet { conv, recurrent } => 4 * (conv.len() + recurrent.len()),
                LayerCache::Attention { k, v } => 4 * (k.len() + v.len()),
            })
            .sum()
    }
}

/// A conversation: the state plus the tokens that produced it (the key for prefix reuse).
#[derive(Clone, Debug)]
pub struct Session {
    pub state: SessionState,
    pub tokens: Vec<u32>,
}

impl Session {
    pub fn new(c: &ModelConfig) -> Self {
        Session {
            state: SessionState::new(c),
            tokens: Vec::new(),
        }
    }
    pub fn position(&self) -> usize {
        self.state.position
    }
    /// A copy of the whole state at this point.
    pub fn snapshot(&self) -> Session {
        self.clone()
    }
    /// Returns to a snapshot taken earlier (of this or another session of the same model).
    pub fn restore(&mut self, snapshot: &Session) {
        self.clone_from(snapshot);
    }
}
