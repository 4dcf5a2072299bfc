//! Per-session key/value cache with O(1) rollback, the state speculation cuts back on rejection.
//!
//! Storage is allocated once at the session's capacity, token-major (`[capacity, kv_heads,
//! head_dim]` per layer), so appending N tokens writes N contiguous rows and `truncate` only
//! moves the length: the kept prefix is never copied. Rows past `len` are dead and are
//! overwritten by the next append.
//!
//! The cache also keeps the token ids its rows hold, so that a worker can tell which prompt
//! prefix a finished session's rows serve ([`KvCache::copy_prefix`]), and the LoRA adapter
//! they were computed with: every pass over the cache applies it.

use crate::error::{EngineError, Result};
use crate::model::Adapter;
use candle_core::{DType, Device, Tensor};
use std::sync::Arc;

/// One session's keys and values for every layer of one model.
#[derive(Debug)]
pub struct KvCache {
    keys: Vec<Tensor>,
    values: Vec<Tensor>,
    len: usize,
    capacity: usize,
    row_width: usize,
    /// The token ids of rows `0..len`.
    tokens: Vec<u32>,
    /// The adapter whose deltas its rows hold (and every pass over it adds).
    adapter: Option<Arc<Adapter>>,
    /// On CUDA, each layer's keys and values' device addresses (the CUDA step writes and
    /// reads the cache through them; the buffers never move).
    #[cfg(feature = "cuda")]
    addrs: Vec<[u64; 2]>,
}

impl Drop for KvCache {
    /// On CUDA, the buffers are freed with the device's context current on this thread
    /// (sessions are often closed on another thread than the one that ran them).
    fn drop(&mut self) {
        #[cfg(feature = "cuda")]
        if let Some(candle_core::Device::Cuda(device)) = self.keys.first().map(Tensor::device) {
            crate::model::cuda::make_current_before_free(device);
        }
    }
}

impl KvCache {
    pub(crate) fn new(
        n_layers: usize,
        n_kv_heads: usize,
        head_dim: usize,
        capacity: usize,
        device: &Device,
        adapter: Option<Arc<Adapter>>,
    ) -> Result<Self> {
        let alloc = || Tensor::zeros((capacity, n_kv_heads, head_dim), DType::F32, device);
        let mut keys = Vec::with_capacity(n_layers);
        let mut values = Vec::with_capacity(n_layers);
        for _ in 0..n_layers {
            keys.push(alloc()?);
            values.push(alloc()?);
        }
        #[cfg(feature = "cuda")]
        let addrs = match device {
            Device::Cuda(_) => keys
                .iter()
                .zip(&values)
                .map(|(k, v)| {
                    use crate::model::cuda::device_addr;
                    Ok([device_addr(k)?, device_addr(v)?])
                })
                .collect::<candle_core::Result<_>>()?,
            _ => Vec::new(),
        };
        Ok(Self {
            keys,
            values,
            len: 0,
            capacity,
            row_width: n_kv_heads * head_dim,
            tokens: Vec::with_capacity(capacity),
            adapter,
            #[cfg(feature = "cuda")]
            addrs,
        })
    }

    /// Tokens whose keys and values are held (the committed prefix).
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The token ids whose keys and values the cache holds, in order.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// The most tokens this cache can hold.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Bytes of device memory this cache holds, for KV budgets.
    pub fn size_in_bytes(&self) -> usize {
        bytes_for(self.keys.len(), self.row_width, self.capacity)
    }

    /// Forgets every token from `len` on, in O(1). Truncating to the current length is a no-op;
    /// growing is an error because the rows past the end hold no valid state.
    pub fn truncate(&mut self, len: usize) -> Result<()> {
        if len > self.len {
            return Err(EngineError::TruncateBeyondEnd {
                requested: len,
                len: self.len,
            });
        }
        self.len = len;
        self.tokens.truncate(len);
        Ok(())
    }

    /// Keeps the first `keep` rows and then the rows `path` (ascending, past `keep`), moved
    /// to follow them: after a pass over a tree of tokens, the one path of it that was
    /// accepted, without computing it again. A row's keys were rotated for the position
    /// after its parent, which is where the move puts it.
    pub fn keep_path(&mut self, keep: usize, path: &[usize]) -> Result<()> {
        let ordered = path
            .iter()
            .enumerate()
            .all(|(j, &row)| row >= keep + j && row < self.len && (j == 0 || row > path[j - 1]));
        if keep > self.len || !ordered {
            let why = format!(
                "rows {path:?} after {keep} of {} are not a path to keep",
                self.len
            );
            return Err(EngineError::BadTree(why));
        }
        for (j, &row) in path.iter().enumerate() {
            if row == keep + j {
                continue;
            }
            for layer in 0..self.keys.len() {
                // Copied out first: the source and destination share the buffer.
                let k = self.keys[layer].narrow(0, row, 1)?.copy()?;
                let v = self.values[layer].narrow(0, row, 1)?.copy()?;
                self.keys[layer].slice_set(&k, 0, keep + j)?;
                self.values[layer].slice_set(&v, 0, keep + j)?;
            }
            self.tokens[keep + j] = self.tokens[row];
        }
        self.truncate(keep + path.len())
    }

    /// Replaces this cache's contents with the first `n` tokens of `from` (keys, values and
    /// ids), copied row for row: a session then starts from another's prompt prefix instead
    /// of computing it again. Both caches must be of one model; `n` must fit both.
    pub fn copy_prefix(&mut self, from: &KvCache, n: usize) -> Result<()> {
        if self.keys.len() != from.keys.len() || self.row_width != from.row_width {
            return Err(EngineError::CacheMismatch);
        }
        if self.adapter_load() != from.adapter_load() {
            return Err(EngineError::CacheMismatch);
        }
        if n > from.len {
            return Err(EngineError::TruncateBeyondEnd {
                requested: n,
                len: from.len,
            });
        }
        if n > self.capacity {
            return Err(EngineError::CacheFull {
                needed: n,
                capacity: self.capacity,
            });
        }
        if n > 0 {
            for layer in 0..self.keys.len() {
                self.keys[layer].slice_set(&from.keys[layer].narrow(0, 0, n)?, 0, 0)?;
                self.values[layer].slice_set(&from.values[layer].narrow(0, 0, n)?, 0, 0)?;
            }
        }
        self.len = n;
        self.tokens.clear();
        self.tokens.extend_from_slice(&from.tokens[..n]);
        Ok(())
    }

    /// Fails without touching the cache when `n` more tokens would not fit.
    pub(crate) fn check_room(&self, n: usize) -> Result<()> {
        let needed = self.len + n;
        if needed > self.capacity {
            return Err(EngineError::CacheFull {
                needed,
                capacity: self.capacity,
            });
        }
        Ok(())
    }

    /// The LoRA adapter its rows hold, if any.
    pub fn adapter(&self) -> Option<&Arc<Adapter>> {
        self.adapter.as_ref()
    }

    fn adapter_load(&self) -> Option<u64> {
        self.adapter.as_deref().map(Adapter::load_number)
    }

    pub(crate) fn matches(&self, n_layers: usize, n_kv_heads: usize, head_dim: usize) -> bool {
        self.keys.len() == n_layers && self.row_width == n_kv_heads * head_dim
    }

    /// Writes `k` and `v` (`[n, kv_heads, head_dim]`) for `layer` at rows `len..len + n`. The
    /// length itself only moves in [`KvCache::commit`], once every layer has been written, so
    /// a forward pass that fails half-way leaves the cache as it was.
    pub(crate) fn write(&self, layer: usize, k: &Tensor, v: &Tensor) -> Result<()> {
        self.keys[layer].slice_set(k, 0, self.len)?;
        self.values[layer].slice_set(v, 0, self.len)?;
        Ok(())
    }

    /// Keys and values of `layer`: all `capacity` rows. During a forward pass the rows from
    /// `len` on hold that pass's tokens (written by [`KvCache::write`], counted only at
    /// [`KvCache::commit`]); rows past them are stale.
    pub(crate) fn layer(&self, layer: usize) -> (&Tensor, &Tensor) {
        (&self.keys[layer], &self.values[layer])
    }

    /// On CUDA, each layer's `[keys, values]` device addresses; empty elsewhere.
    #[cfg(feature = "cuda")]
    pub(crate) fn device_addrs(&self) -> &[[u64; 2]] {
        &self.addrs
    }

    /// Counts the rows a pass wrote for `tokens` as held.
    pub(crate) fn commit(&mut self, tokens: &[u32]) {
        debug_assert!(self.len + tokens.len() <= self.capacity);
        self.len += tokens.len();
        self.tokens.extend_from_slice(tokens);
    }
}

/// Tokens per block of a prefix's hashes: a cached prefix is found a block at a time.
pub const PREFIX_BLOCK_TOKENS: usize = 32;

/// Chained hashes of the whole [`PREFIX_BLOCK_TOKENS`]-token blocks of `tokens`: hash `i`
/// stands for `tokens[..(i + 1) * PREFIX_BLOCK_TOKENS]`, so two sequences share hash `i` only
/// if (barring a collision, which users of the hashes check for) they share all of it. The
/// chain starts from `salt` (a request's cache salt; 0: none), so sequences of different
/// salts share no hash.
pub fn prefix_block_hashes(tokens: &[u32], salt: u64) -> Vec<u64> {
    use std::hash::{Hash, Hasher};
    let mut chain = salt;
    tokens
        .chunks_exact(PREFIX_BLOCK_TOKENS)
        .map(|block| {
            let mut h = std::hash::DefaultHasher::new();
            chain.hash(&mut h);
            block.hash(&mut h);
            chain = h.finish();
            chain
        })
        .collect()
}

/// The salt of a prefix cache's blocks for sessions of `adapter` (its rows hold the
/// adapter's deltas): `salt` itself without one, else a salt of the two, so that sessions of
/// different adapters share no block.
pub fn adapter_salt(salt: u64, adapter: Option<&str>) -> u64 {
    use std::hash::{Hash, Hasher};
    let Some(name) = adapter else { return salt };
    let mut hasher = std::hash::DefaultHasher::new();
    (salt, name).hash(&mut hasher);
    hasher.finish()
}

/// Bytes of a cache of `capacity` tokens: keys and values, `row_width` f32 per token per layer.
pub(crate) fn bytes_for(n_layers: usize, row_width: usize, capacity: usize) -> usize {
    2 * n_layers * capacity * row_width * std::mem::size_of::<f32>()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn truncate_and_capacity_rules() {
        let mut cache = KvCache::new(2, 1, 4, 8, &Device::Cpu, None).unwrap();
        assert_eq!((cache.len(), cache.capacity()), (0, 8));
        assert!(cache.check_room(8).is_ok());
        assert!(matches!(
            cache.check_room(9),
            Err(EngineError::CacheFull {
                needed: 9,
                capacity: 8
            })
        ));
        cache.commit(&[10, 11, 12, 13, 14]);
        cache.truncate(3).unwrap();
        assert_eq!(cache.len(), 3);
        assert_eq!(cache.tokens(), &[10, 11, 12]);
        assert!(matches!(
            cache.truncate(4),
            Err(EngineError::TruncateBeyondEnd {
                requested: 4,
                len: 3
            })
        ));
        cache.truncate(3).unwrap();
        assert_eq!(cache.size_in_bytes(), 2 * 2 * 8 * 4 * 4);
    }

    /// Block hashes cover whole blocks only and chain: a difference in block 0 changes
    /// every later hash, one in block 1 only those from 1 on.
    #[test]
    fn prefix_block_hashes_chain_whole_blocks() {
        let b = PREFIX_BLOCK_TOKENS as u32;
        let a: Vec<u32> = (0..3 * b + 5).collect();
        assert_eq!(prefix_block_hashes(&a, 0).len(), 3);
        assert_eq!(
            prefix_block_hashes(&a[..b as usize - 1], 0),
            Vec::<u64>::new()
        );
        let mut other = a.clone();
        other[b as usize + 1] = 9999;
        let (x, y) = (prefix_block_hashes(&a, 0), prefix_block_hashes(&other, 0));
        assert_eq!(x[0], y[0]);
        assert_ne!(x[1], y[1]);
        assert_ne!(x[2], y[2]);
        other[0] = 9999;
        assert!(
            prefix_block_hashes(&other, 0)
                .iter()
                .zip(&x)
                .all(|(p, q)| p != q)
        );
        assert_eq!(prefix_block_hashes(&a[..2 * b as usize], 0), x[..2]);
        // Another salt: no hash in common; the same salt: the same hashes.
        let salted = prefix_block_hashes(&a, 7);
        assert!(salted.iter().zip(&x).all(|(p, q)| p != q));
        assert_eq!(prefix_block_hashes(&a, 7), salted);
    }

    /// A copied prefix holds the source's rows and ids and nothing past them; a prefix
    /// longer than the source holds, or than the copy's capacity, or of another shape fails.
    #[test]
    fn copy_prefix_takes_rows_and_ids() {
        let from = KvCache::new(2, 1, 2, 8, &Device::Cpu, None).unwrap();
        for layer in 0..2 {
            let rows = |base: f32| {
                let data: Vec<f32> = (0..8).map(|i| base + i as f32).collect();
                Tensor::from_vec(data, (4, 1, 2), &Device::Cpu).unwrap()
            };
            from.write(
                layer,
                &rows(100.0 * layer as f32),
                &rows(-100.0 * layer as f32 - 50.0),
            )
            .unwrap();
        }
        let mut from = from;
        from.commit(&[7, 8, 9, 10]);
        let mut to = KvCache::new(2, 1, 2, 5, &Device::Cpu, None).unwrap();
        to.commit(&[1]);
        to.copy_prefix(&from, 3).unwrap();
        assert_eq!((to.len(), to.tokens()), (3, &[7u32, 8, 9][..]));
        let (k, v) = to.layer(1);
        let head = |t: &Tensor| {
            t.narrow(0, 0, 3)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap()
        };
        assert_eq!(head(k), [100.0, 101.0, 102.0, 103.0, 104.0, 105.0]);
        assert_eq!(head(v), [-150.0, -149.0, -148.0, -147.0, -146.0, -145.0]);
        assert!(matches!(
            to.copy_prefix(&from, 5),
            Err(EngineError::TruncateBeyondEnd { .. })
        ));
        let small = KvCache::new(2, 1, 2, 2, &Device::Cpu, None).unwrap();
        assert!(matches!(
            {
                let mut s = small;
                s.copy_prefix(&from, 3)
            },
            Err(EngineError::CacheFull {
                needed: 3,
                capacity: 2
            })
        ));
        let mut other = KvCache::new(3, 1, 2, 8, &Device::Cpu, None).unwrap();
        assert!(matches!(
            other.copy_prefix(&from, 1),
            Err(EngineError::CacheMismatch)
        ));
    }
}
