//! A caller's tensor descriptor once read ([`Desc`]), and the shape checks every operation
//! makes before it hands an address to gin-ep.

use crate::abi::{NCCL_BFLOAT16, NCCL_FLOAT32, NCCL_FLOAT8E4M3, NCCL_INT32, NCCL_INT64, NCCL_UINT8};
use crate::status::{CResult, CapiError};

/// A tensor the caller described: where it is, its element type and extents.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Desc {
    /// The argument path the caller knows it by (`outputs->tokens`), for messages.
    pub name: String,
    pub dtype: i32,
    pub data: u64,
    pub sizes: Vec<usize>,
}

/// The name of an `ncclDataType_t` value (for messages).
pub fn dtype_name(d: i32) -> String {
    let n = match d {
        0 => "ncclInt8",
        NCCL_UINT8 => "ncclUint8",
        NCCL_INT32 => "ncclInt32",
        3 => "ncclUint32",
        NCCL_INT64 => "ncclInt64",
        5 => "ncclUint64",
        6 => "ncclFloat16",
        NCCL_FLOAT32 => "ncclFloat32",
        8 => "ncclFloat64",
        NCCL_BFLOAT16 => "ncclBfloat16",
        NCCL_FLOAT8E4M3 => "ncclFloat8e4m3",
        11 => "ncclFloat8e5m2",
        12 => "ncclFloat4x2",
        _ => return format!("ncclDataType_t {d}"),
    };
    n.to_string()
}

/// Bytes of one element of `d`, or None for a type gin-ep never reads.
pub fn elem_bytes(d: i32) -> Option<usize> {
    match d {
        0 | NCCL_UINT8 | NCCL_FLOAT8E4M3 | 11 | 12 => Some(1),
        6 | NCCL_BFLOAT16 => Some(2),
        NCCL_INT32 | 3 | NCCL_FLOAT32 => Some(4),
        NCCL_INT64 | 5 | 8 => Some(8),
        _ => None,
    }
}

impl Desc {
    pub fn elems(&self) -> usize {
        self.sizes.iter().product()
    }

    pub fn bytes(&self) -> usize {
        self.elems() * elem_bytes(self.dtype).unwrap_or(0)
    }

    /// `(address, bytes)` of the whole tensor.
    pub fn span(&self) -> (u64, usize) {
        (self.data, self.bytes())
    }

    /// Refuses any element type but `want` (ncclInvalidUsage: gin-ep has no kernel for it).
    pub fn dtype_is(&self, want: &[i32]) -> CResult<()> {
        if want.contains(&self.dtype) {
            return Ok(());
        }
        let names: Vec<String> = want.iter().map(|&d| dtype_name(d)).collect();
        Err(CapiError::usage(format!(
            "{}->datatype = {}: gin-ep takes {} here",
            self.name,
            dtype_name(self.dtype),
            names.join(" or ")
        )))
    }

    /// Refuses any shape but `want` (ncclInvalidArgument).
    pub fn shape_is(&self, want: &[usize]) -> CResult<()> {
        if self.sizes == want {
            return Ok(());
        }
        Err(CapiError::arg(format!(
            "{}->sizes = {:?}: expected {:?}",
            self.name, self.sizes, want
        )))
    }

    /// Refuses a shape of another rank or with a dimension other than `want` where given.
    pub fn shape_like(&self, want: &[Option<usize>]) -> CResult<()> {
        let fits = self.sizes.len() == want.len()
            && self
                .sizes
                .iter()
                .zip(want)
                .all(|(s, w)| w.is_none_or(|w| *s == w));
        if fits {
            return Ok(());
        }
        let pattern: Vec<String> = want
            .iter()
            .map(|w| w.map_or_else(|| "*".to_string(), |w| w.to_string()))
            .collect();
        Err(CapiError::arg(format!(
            "{}->sizes = {:?}: expected [{}]",
            self.name,
            self.sizes,
            pattern.join(", ")
        )))
    }
}

/// A required tensor: present, or ncclInvalidArgument naming it.
pub fn required(t: Option<Desc>, name: &str) -> CResult<Desc> {
    t.ok_or_else(|| CapiError::arg(format!("{name} is NULL (required)")))
}

/// Refuses the first of `tensors` the caller passed (`why` says why the call has no use for
/// it): a tensor gin-ep would ignore is refused by name, never silently dropped.
pub fn absent(tensors: &[(&Option<Desc>, &str)], why: &str) -> CResult<()> {
    match tensors.iter().find(|(t, _)| t.is_some()) {
        Some((_, name)) => Err(CapiError::usage(format!("{name}: {why}"))),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(sizes: &[usize], dtype: i32) -> Desc {
        Desc {
            name: "outputs->tokens".into(),
            dtype,
            data: 0x1000,
            sizes: sizes.to_vec(),
        }
    }

    #[test]
    fn bytes_follow_dtype() {
        assert_eq!(t(&[2, 3, 8], NCCL_BFLOAT16).bytes(), 96);
        assert_eq!(t(&[4], NCCL_INT64).bytes(), 32);
    }

    #[test]
    fn wrong_shape_and_dtype_are_named() {
        let e = t(&[2, 8], NCCL_BFLOAT16).shape_is(&[2, 16]).unwrap_err();
        assert!(
            e.msg.contains("outputs->tokens->sizes = [2, 8]") && e.msg.contains("[2, 16]"),
            "{}",
            e.msg
        );
        let e = t(&[2, 8], 6).dtype_is(&[NCCL_BFLOAT16]).unwrap_err();
        assert!(
            e.msg.contains("ncclFloat16") && e.msg.contains("ncclBfloat16"),
            "{}",
            e.msg
        );
        assert_eq!(e.code, crate::abi::NCCL_INVALID_USAGE);
        t(&[5, 8], NCCL_BFLOAT16).shape_like(&[None, Some(8)]).unwrap();
        assert!(t(&[5, 9], NCCL_BFLOAT16).shape_like(&[None, Some(8)]).is_err());
    }
}
