//! Typed views of device outputs the library owns (HT receive slabs, LL buffer sets): what
//! the engine hands its embeddings instead of raw regions.

/// The element type of a device output.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ElemType {
    Bf16,
    /// FP8 e4m3 bytes.
    E4m3,
    F32,
    I32,
    I64,
}

impl ElemType {
    /// Bytes of one element.
    pub fn size(self) -> usize {
        match self {
            ElemType::E4m3 => 1,
            ElemType::Bf16 => 2,
            ElemType::F32 | ElemType::I32 => 4,
            ElemType::I64 => 8,
        }
    }
}

/// One output in device memory the library owns: its address, shape (contiguous,
/// row-major) and element type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceView {
    pub ptr: u64,
    dims: [usize; 2],
    ndim: u8,
    pub elem: ElemType,
}

impl DeviceView {
    /// `[rows]` (no `cols`) or `[rows, cols]`.
    pub fn new(ptr: u64, rows: usize, cols: Option<usize>, elem: ElemType) -> DeviceView {
        DeviceView {
            ptr,
            dims: [rows, cols.unwrap_or(1)],
            ndim: if cols.is_some() { 2 } else { 1 },
            elem,
        }
    }

    pub fn shape(&self) -> &[usize] {
        &self.dims[..usize::from(self.ndim)]
    }

    pub fn bytes(&self) -> usize {
        self.shape().iter().product::<usize>() * self.elem.size()
    }
}
