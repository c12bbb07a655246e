//! A stream capture turned into a replayable CUDA graph, optionally with programmatic
//! dependent launch (PDL, sm_90+) between consecutive kernels.
//!
//! A decode step is a chain of ~100 small kernels, each a few microseconds long; the gap
//! between one kernel's end and the next one's start is a large share of the step. With a
//! programmatic edge the next kernel is launched while the previous one still runs: its blocks
//! start, then wait in `griddepcontrol.wait` until the previous grid has completed and its
//! writes are visible. Every memra kernel calls that wait (`memra::pdl_entry` in
//! templates/memra/common.cuh) before it reads anything an earlier kernel writes, so a
//! programmatic edge orders memory exactly like a normal one; what overlaps is the launch and
//! the work before the wait (the projections' first weight chunks, the attention's first cache
//! rows and RoPE angles). Edges touching anything other than two kernel nodes (memset, memcpy)
//! are left as they are. The decoders use it unless `GpuOptions::pdl` is off
//! (models::gpu::StepGraph; `memra run --no-pdl`).

use std::sync::Arc;

use cudarc::driver::{sys, CudaStream};

use crate::cuda::Error;

/// A captured and instantiated graph, launched on the stream it was captured from.
pub struct Graph {
    graph: sys::CUgraph,
    exec: sys::CUgraphExec,
    stream: Arc<CudaStream>,
    programmatic_edges: usize,
}

fn check(call: &str, r: sys::CUresult) -> Result<(), Error> {
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(Error::driver(call, r))
    }
}

impl Graph {
    /// Captures the work `enqueue` puts on `stream` (thread-local capture mode) and instantiates
    /// it; with `programmatic`, kernel → kernel edges become programmatic (see the module doc).
    /// `enqueue`'s own error wins over a capture error.
    pub fn capture<E: From<Error>>(
        stream: &Arc<CudaStream>,
        programmatic: bool,
        enqueue: impl FnOnce() -> Result<(), E>,
    ) -> Result<Graph, E> {
        stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(|e| Error::driver("cuStreamBeginCapture", e))?;
        let queued = enqueue();
        let mut graph: sys::CUgraph = std::ptr::null_mut();
        // SAFETY: the stream is capturing (begun above); on success `graph` owns the capture.
        let ended = check("cuStreamEndCapture", unsafe {
            sys::cuStreamEndCapture(stream.cu_stream(), &mut graph)
        });
        queued?;
        ended?;
        if graph.is_null() {
            return Err(
                Error::driver("cuStreamEndCapture", "the capture produced no graph").into(),
            );
        }
        let mut this = Graph {
            graph,
            exec: std::ptr::null_mut(),
            stream: stream.clone(),
            programmatic_edges: 0,
        };
        if programmatic {
            this.programmatic_edges = this.make_kernel_edges_programmatic()?;
        }
        // SAFETY: `this.graph` is a valid graph owned by `this`; the exec is destroyed in Drop.
        check("cuGraphInstantiateWithFlags", unsafe {
            sys::cuGraphInstantiateWithFlags(&mut this.exec, this.graph, 0)
        })?;
        Ok(this)
    }

    /// How many edges were made programmatic (0 without PDL).
    pub fn programmatic_edges(&self) -> usize {
        self.programmatic_edges
    }

    pub fn launch(&self) -> Result<(), Error> {
        // SAFETY: `exec` was instantiated from this graph; the stream outlives `self` (Arc).
        check("cuGraphLaunch", unsafe {
            sys::cuGraphLaunch(self.exec, self.stream.cu_stream())
        })
    }

    fn make_kernel_edges_programmatic(&mut self) -> Result<usize, Error> {
        let mut n = 0usize;
        // SAFETY (all calls below): `self.graph` is a valid, not yet instantiated graph; the
        // arrays passed hold `n` elements as the driver was told.
        unsafe {
            check(
                "cuGraphGetEdges_v2",
                sys::cuGraphGetEdges_v2(
                    self.graph,
                    std::ptr::null_mut(),
                    std::ptr::null_mut(),
                    std::ptr::null_mut(),
                    &mut n,
                ),
            )?;
            let mut from = vec![std::ptr::null_mut(); n];
            let mut to = vec![std::ptr::null_mut(); n];
            let mut data = vec![std::mem::zeroed::<sys::CUgraphEdgeData>(); n];
            check(
                "cuGraphGetEdges_v2",
                sys::cuGraphGetEdges_v2(
                    self.graph,
                    from.as_mut_ptr(),
                    to.as_mut_ptr(),
                    data.as_mut_ptr(),
                    &mut n,
                ),
            )?;
            let is_kernel = |node: sys::CUgraphNode| -> Result<bool, Error> {
                let mut ty = sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_EMPTY;
                check("cuGraphNodeGetType", sys::cuGraphNodeGetType(node, &mut ty))?;
                Ok(ty == sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_KERNEL)
            };
            let mut changed = 0;
            for i in 0..n {
                let default_edge = data[i].type_
                    == sys::CUgraphDependencyType::CU_GRAPH_DEPENDENCY_TYPE_DEFAULT as u8;
                if !default_edge || !is_kernel(from[i])? || !is_kernel(to[i])? {
                    continue;
                }
                check(
                    "cuGraphRemoveDependencies_v2",
                    sys::cuGraphRemoveDependencies_v2(self.graph, &from[i], &to[i], &data[i], 1),
                )?;
                let mut edge = data[i];
                edge.type_ =
                    sys::CUgraphDependencyType::CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC as u8;
                // The dependent may launch once every block of the previous grid has run
                // `griddepcontrol.launch_dependents` (the first thing pdl_entry does).
                edge.from_port = sys::CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC as u8;
                check(
                    "cuGraphAddDependencies_v2",
                    sys::cuGraphAddDependencies_v2(self.graph, &from[i], &to[i], &edge, 1),
                )?;
                changed += 1;
            }
            Ok(changed)
        }
    }
}

impl Drop for Graph {
    fn drop(&mut self) {
        // SAFETY: both handles are owned by `self` and destroyed once; errors cannot be reported
        // from Drop and leave nothing to undo.
        unsafe {
            if !self.exec.is_null() {
                let _ = sys::cuGraphExecDestroy(self.exec);
            }
            if !self.graph.is_null() {
                let _ = sys::cuGraphDestroy(self.graph);
            }
        }
    }
}
