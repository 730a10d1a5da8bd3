//! The decode gemv's instructions per weight byte, counted in the SPIR-V that naga writes for it
//! (what wgpu hands a Vulkan driver, as the engine compiles it natively: no runtime checks), for
//! a GPU with shader-f16 and subgroups (the kernels an NVIDIA card runs), on any machine:
//! `bench --json`'s `gemv_instructions_per_weight_byte` (and `gemv_int8_...` for the int8
//! kernel), pinned by tests/properties/ledger.rs.
//!
//! What is counted: one trip of the gemv's weight loop (the loop that calls the weight function,
//! `dq8` or the int8 kernel's `q8w`, itself), from its header back to it, as the GPU runs it for
//! a single sequence's step (MB = 1: the batch rows' inner loop once), over the weight bytes
//! that trip reads (8 values of the block type; the int8 kernel's a block of 32). Calls count
//! as their callee's body (drivers inline them); a branch on a constant takes its side, any
//! other `if` its longer arm; loads and stores of function variables and their access chains
//! are not counted (drivers keep those in registers), nor access chains with constant indices
//! (fixed offsets), labels, merges and plain branches; a vector instruction counts once. A
//! static count, not a profile: what moves when a kernel does less work per byte.

use super::device::GPU_LANES;
use super::kernels::{Epilogue, GemvProgram};
use super::shader::{assemble_for, Target};
use super::weights::GemvShape;
use super::KvStore;
use crate::arch::Activation;
use crate::quant::BlockFormat;
use std::collections::{HashMap, HashSet};
use wgpu::naga;

const OP_NAME: u32 = 5;
const OP_LINE: u32 = 8;
const OP_CONSTANT_TRUE: u32 = 41;
const OP_CONSTANT: u32 = 43;
const OP_CONSTANT_FALSE: u32 = 42;
const OP_FUNCTION: u32 = 54;
const OP_FUNCTION_PARAMETER: u32 = 55;
const OP_FUNCTION_END: u32 = 56;
const OP_FUNCTION_CALL: u32 = 57;
const OP_VARIABLE: u32 = 59;
const OP_LOAD: u32 = 61;
const OP_STORE: u32 = 62;
const OP_ACCESS_CHAIN: u32 = 65;
const OP_LOOP_MERGE: u32 = 246;
const OP_SELECTION_MERGE: u32 = 247;
const OP_LABEL: u32 = 248;
const OP_BRANCH: u32 = 249;
const OP_BRANCH_CONDITIONAL: u32 = 250;
const OP_SWITCH: u32 = 251;
const OP_NO_LINE: u32 = 317;
/// SPIR-V's Function storage class.
const FUNCTION_STORAGE: u32 = 7;

/// The columns of the gemv the counts are for (a 4096-wide model's; the count does not depend
/// on it).
const COLS: usize = 4096;

/// Instructions a trip of the decode gemv's weight loop runs over the weight bytes it reads,
/// for `format`'s plain product (no fused norm, stored), as the SPIR-V naga writes has it; with
/// `int8`, the int8-activation kernel's (`Gpu::int8`; an error for formats it does not take).
pub fn gemv_instructions_per_weight_byte(format: &'static BlockFormat, int8: bool) -> Result<f64, String> {
    if int8 && format.int8_fn().is_none() {
        return Err(format!("no int8 gemv for {}", format.ty.name()));
    }
    let row_words = format.gpu_row_words(COLS).ok_or("a row that does not fill whole blocks")?;
    let shape = GemvShape { format, cols: COLS, row_words, rows: COLS, out: 0, pair: false };
    let p = GemvProgram::new(shape, GPU_LANES, 1, Activation::Silu, Epilogue::Store, None, None, false, COLS, int8);
    let target = Target { f16: true, subgroups: true, subgroup_min: GPU_LANES, kv: KvStore::F16 };
    let source = assemble_for(target, &p.kernel, p.needs, &p.consts);
    let words = compile(&source, &p.overrides)?;
    let (callee, trip_values) = p.weight_fn;
    let trip = Module::parse(&words)?.loop_trip("main", callee)?;
    let (values, bytes) = format.ty.block_layout();
    Ok(trip as f64 / (trip_values as f64 * bytes as f64 / values as f64))
}

/// `source`'s SPIR-V with `overrides` applied, as wgpu-hal's Vulkan backend writes it for the
/// engine's trusted kernels.
fn compile(source: &str, overrides: &[(&str, f64)]) -> Result<Vec<u32>, String> {
    use naga::valid::{Capabilities, ValidationFlags, Validator};
    let module = naga::front::wgsl::parse_str(source).map_err(|e| e.emit_to_string(source))?;
    let info = Validator::new(ValidationFlags::all(), Capabilities::all())
        .validate(&module)
        .map_err(|e| e.emit_to_string(source))?;
    let mut constants = naga::back::PipelineConstants::default();
    constants.extend(overrides.iter().map(|&(k, v)| (k.to_string(), v)));
    let stage = (naga::ShaderStage::Compute, "main");
    let (module, info) = naga::back::pipeline_constants::process_overrides(&module, &info, Some(stage), &constants)
        .map_err(|e| e.to_string())?;
    let unchecked = naga::proc::BoundsCheckPolicy::Unchecked;
    let options = naga::back::spv::Options {
        lang_version: (1, 3),
        flags: naga::back::spv::WriterFlags::DEBUG,
        bounds_check_policies: naga::proc::BoundsCheckPolicies {
            index: unchecked,
            buffer: unchecked,
            image_load: unchecked,
            binding_array: unchecked,
        },
        force_loop_bounding: false,
        emit_int_div_checks: false,
        ..Default::default()
    };
    let pipeline =
        naga::back::spv::PipelineOptions { shader_stage: naga::ShaderStage::Compute, entry_point: "main".into() };
    naga::back::spv::write_vec(&module, &info, &options, Some(&pipeline)).map_err(|e| e.to_string())
}

struct Instruction {
    op: u32,
    operands: Vec<u32>,
}

struct Block {
    label: u32,
    body: Vec<Instruction>,
    /// OpLoopMerge's (merge, continue) or OpSelectionMerge's merge (in `.0`).
    loop_merge: Option<(u32, u32)>,
    selection_merge: Option<u32>,
    terminator: Instruction,
}

struct Function {
    blocks: Vec<Block>,
    index: HashMap<u32, usize>,
}

struct Module {
    names: HashMap<u32, String>,
    bools: HashMap<u32, bool>,
    functions: HashMap<u32, Function>,
    /// Pointers into function variables (the variables and their access chains).
    local: HashSet<u32>,
    /// Scalar constants: an access chain with only these for indices is a fixed offset, folded
    /// into the load or store that uses it.
    constants: HashSet<u32>,
}

/// One path's cost, and the functions it calls outside nested loops.
#[derive(Default)]
struct Cost {
    instructions: usize,
    calls: HashSet<u32>,
}

impl Module {
    fn parse(words: &[u32]) -> Result<Self, String> {
        let mut m = Module {
            names: HashMap::new(),
            bools: HashMap::new(),
            functions: HashMap::new(),
            local: HashSet::new(),
            constants: HashSet::new(),
        };
        let mut at = 5;
        let (mut function, mut fid, mut block): (Option<Function>, u32, Option<Block>) = (None, 0, None);
        while at < words.len() {
            let (len, op) = ((words[at] >> 16) as usize, words[at] & 0xffff);
            if len == 0 || at + len > words.len() {
                return Err("malformed SPIR-V".into());
            }
            let operands = words[at + 1..at + len].to_vec();
            at += len;
            match op {
                OP_NAME => {
                    let bytes: Vec<u8> =
                        operands[1..].iter().flat_map(|w| w.to_le_bytes()).take_while(|&b| b != 0).collect();
                    m.names.insert(operands[0], String::from_utf8_lossy(&bytes).into_owned());
                }
                OP_CONSTANT_TRUE | OP_CONSTANT_FALSE => {
                    m.bools.insert(operands[1], op == OP_CONSTANT_TRUE);
                }
                OP_CONSTANT => {
                    m.constants.insert(operands[1]);
                }
                OP_FUNCTION => {
                    function = Some(Function { blocks: Vec::new(), index: HashMap::new() });
                    fid = operands[1];
                }
                OP_FUNCTION_END => {
                    let f = function.take().ok_or("OpFunctionEnd outside a function")?;
                    m.functions.insert(fid, f);
                }
                OP_LABEL => {
                    let term = Instruction { op: 0, operands: Vec::new() };
                    block = Some(Block {
                        label: operands[0],
                        body: Vec::new(),
                        loop_merge: None,
                        selection_merge: None,
                        terminator: term,
                    });
                }
                _ if block.is_none() => {}
                OP_LOOP_MERGE => block.as_mut().expect("in a block").loop_merge = Some((operands[0], operands[1])),
                OP_SELECTION_MERGE => block.as_mut().expect("in a block").selection_merge = Some(operands[0]),
                OP_BRANCH | OP_BRANCH_CONDITIONAL | OP_SWITCH | 252..=255 => {
                    let mut b = block.take().expect("in a block");
                    b.terminator = Instruction { op, operands };
                    let f = function.as_mut().ok_or("a block outside a function")?;
                    f.index.insert(b.label, f.blocks.len());
                    f.blocks.push(b);
                }
                _ => {
                    if op == OP_VARIABLE && operands.get(2) == Some(&FUNCTION_STORAGE) {
                        m.local.insert(operands[1]);
                    }
                    if op == OP_ACCESS_CHAIN && m.local.contains(&operands[2]) {
                        m.local.insert(operands[1]);
                    }
                    block.as_mut().expect("in a block").body.push(Instruction { op, operands });
                }
            }
        }
        Ok(m)
    }

    fn function_named(&self, name: &str) -> Result<u32, String> {
        let mut ids = self.functions.keys().filter(|id| self.names.get(id).is_some_and(|n| n == name));
        ids.next().copied().ok_or_else(|| format!("no function {name} in the SPIR-V"))
    }

    /// Instructions of one trip of the loop in `entry` that calls `callee` itself.
    fn loop_trip(&self, entry: &str, callee: &str) -> Result<usize, String> {
        let (f, target) = (self.function_named(entry)?, self.function_named(callee)?);
        let func = &self.functions[&f];
        for b in &func.blocks {
            let Some((merge, _)) = b.loop_merge else { continue };
            let trip = self.trip(func, b, merge, 0)?;
            if trip.calls.contains(&target) {
                return Ok(trip.instructions);
            }
        }
        Err(format!("no loop of {entry} calls {callee}"))
    }

    /// One trip of the loop headed by `header`: from its header back to it (or out of it).
    fn trip(&self, f: &Function, header: &Block, merge: u32, depth: usize) -> Result<Cost, String> {
        let mut cost = Cost::default();
        self.add_body(header, &mut cost, depth)?;
        let stop = [header.label, merge];
        let next = match &header.terminator {
            Instruction { op: OP_BRANCH, operands } => Some(operands[0]),
            t => self.terminator(f, header, t, &stop, &mut cost, depth)?,
        };
        if let Some(next) = next {
            self.path(f, next, &stop, &mut cost, depth)?;
        }
        Ok(cost)
    }

    /// The cost of the path from `label` until one of `stop`.
    fn path(&self, f: &Function, label: u32, stop: &[u32], cost: &mut Cost, depth: usize) -> Result<(), String> {
        if depth > 64 {
            return Err("control flow nested too deep".into());
        }
        let mut label = label;
        for _ in 0..100_000 {
            if stop.contains(&label) {
                return Ok(());
            }
            let b = &f.blocks[*f.index.get(&label).ok_or_else(|| format!("a branch to no block %{label}"))?];
            if let Some((merge, _)) = b.loop_merge {
                // A nested loop: one trip (decode's batch rows: MB = 1), its calls not the
                // enclosing loop's own.
                let trip = self.trip(f, b, merge, depth + 1)?;
                cost.instructions += trip.instructions;
                label = merge;
                continue;
            }
            self.add_body(b, cost, depth)?;
            match &b.terminator {
                Instruction { op: OP_BRANCH, operands } => label = operands[0],
                t => {
                    let Some(next) = self.terminator(f, b, t, stop, cost, depth)? else { return Ok(()) };
                    label = next;
                }
            }
        }
        Err("a path that does not end".into())
    }

    /// A conditional branch or switch: its taken side's cost; returns where the path goes on
    /// (None: it ended).
    fn terminator(
        &self,
        f: &Function,
        b: &Block,
        t: &Instruction,
        stop: &[u32],
        cost: &mut Cost,
        depth: usize,
    ) -> Result<Option<u32>, String> {
        let targets: Vec<u32> = match t.op {
            OP_BRANCH_CONDITIONAL => {
                cost.instructions += 1;
                if let Some(&taken) = self.bools.get(&t.operands[0]) {
                    return Ok(Some(if taken { t.operands[1] } else { t.operands[2] }));
                }
                vec![t.operands[1], t.operands[2]]
            }
            // The selector, the default, then (32-bit literal, label) pairs.
            OP_SWITCH => t.operands.iter().skip(3).step_by(2).copied().chain([t.operands[1]]).collect(),
            _ => return Ok(None),
        };
        // The loop's way out (or back) is not taken while the trip goes on.
        let inside: Vec<u32> = targets.iter().copied().filter(|l| !stop.contains(l)).collect();
        match (inside.as_slice(), b.selection_merge) {
            ([], _) => Ok(None),
            ([one], None) => Ok(Some(*one)),
            (arms, Some(merge)) => {
                let mut stop = stop.to_vec();
                stop.push(merge);
                let mut longest = Cost::default();
                for &arm in arms {
                    let mut c = Cost::default();
                    self.path(f, arm, &stop, &mut c, depth + 1)?;
                    if c.instructions >= longest.instructions {
                        longest.instructions = c.instructions;
                    }
                    longest.calls.extend(c.calls);
                }
                cost.instructions += longest.instructions;
                cost.calls.extend(longest.calls);
                Ok(Some(merge))
            }
            (arms, None) => Ok(arms.first().copied()),
        }
    }

    /// A block's instructions, calls as their callees' bodies.
    fn add_body(&self, b: &Block, cost: &mut Cost, depth: usize) -> Result<(), String> {
        for i in &b.body {
            match i.op {
                OP_LINE | OP_NO_LINE | OP_VARIABLE | OP_FUNCTION_PARAMETER => {}
                OP_LOAD if self.local.contains(&i.operands[2]) => {}
                OP_STORE if self.local.contains(&i.operands[0]) => {}
                OP_ACCESS_CHAIN if self.local.contains(&i.operands[1]) => {}
                OP_ACCESS_CHAIN if i.operands[3..].iter().all(|id| self.constants.contains(id)) => {}
                OP_FUNCTION_CALL => {
                    let callee = i.operands[2];
                    cost.calls.insert(callee);
                    let f = self.functions.get(&callee).ok_or("a call of no function")?;
                    let first = f.blocks.first().ok_or("a function without blocks")?;
                    let mut c = Cost::default();
                    self.add_body(first, &mut c, depth + 1)?;
                    match &first.terminator {
                        Instruction { op: OP_BRANCH, operands } => self.path(f, operands[0], &[], &mut c, depth + 1)?,
                        t => {
                            if let Some(next) = self.terminator(f, first, t, &[], &mut c, depth + 1)? {
                                self.path(f, next, &[], &mut c, depth + 1)?;
                            }
                        }
                    }
                    cost.instructions += c.instructions;
                }
                _ => cost.instructions += 1,
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A loop counted by hand: the `for` test (compare, branch), the `if` (compare, branch, its
    /// longer arm's add and xor), the call's body (access chain, load, multiply), the sum and
    /// the increment; the local variables' loads and stores are free.
    #[test]
    fn a_small_loop_counts_as_by_hand() {
        let source = "
            @group(0) @binding(0) var<storage, read_write> buf: array<u32>;
            fn dq8(i: u32) -> u32 { return buf[i] * 3u; }
            @compute @workgroup_size(1) fn main() {
                var acc = 0u;
                for (var i = 0u; i < 8u; i++) {
                    if i == 5u { acc += 7u; acc ^= 1u; }
                    acc += dq8(i);
                }
                buf[0] = acc;
            }";
        let words = compile(source, &[]).unwrap();
        assert_eq!(Module::parse(&words).unwrap().loop_trip("main", "dq8").unwrap(), 2 + 2 + 2 + 3 + 1 + 1);
    }

    /// The cooperative-matrix gemm (shaders/gemm_coop.wgsl) for a GPU's 16 x 16 matrices (which
    /// no adapter here runs: lavapipe's are 8 x 8) and for 8 x 8 ones compiles to SPIR-V whose
    /// K step is four cooperative products of four cooperative loads, and whose accumulators
    /// leave by one cooperative store.
    #[test]
    fn the_coop_gemm_compiles_to_cooperative_products_for_either_side() {
        use crate::gpu::kernels::{coop_gemm_kernel, coop_subgroups};
        const OP_COOP_LOAD: u32 = 4457;
        const OP_COOP_STORE: u32 = 4458;
        const OP_COOP_MUL_ADD: u32 = 4459;
        let format = crate::quant::format(crate::gguf::GgmlType::Q4_0).unwrap();
        for side in [16, 8] {
            let target = Target { f16: true, subgroups: true, subgroup_min: GPU_LANES, kv: KvStore::F16 };
            let needs = crate::gpu::shader::Needs { weights: Some(format), coop: true, ..Default::default() };
            let source = assemble_for(target, &coop_gemm_kernel(side), needs, &[]);
            let overrides = [
                ("COLS", COLS as f64),
                ("ROW_WORDS", format.gpu_row_words(COLS).unwrap() as f64),
                ("ROW_COUNT", COLS as f64),
                ("Y_STRIDE", COLS as f64),
                ("WG", (coop_subgroups(side) * GPU_LANES) as f64),
            ];
            let words = compile(&source, &overrides).unwrap_or_else(|e| panic!("side {side}: {e}"));
            let mut ops = HashMap::new();
            let mut at = 5;
            while at < words.len() {
                *ops.entry(words[at] & 0xffff).or_insert(0) += 1;
                at += (words[at] >> 16) as usize;
            }
            let count = |op| ops.get(&op).copied().unwrap_or(0);
            assert_eq!((count(OP_COOP_LOAD), count(OP_COOP_MUL_ADD), count(OP_COOP_STORE)), (4, 4, 1), "side {side}");
        }
    }
}
