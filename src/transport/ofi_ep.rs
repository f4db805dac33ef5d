//! One libfabric endpoint per process: fabric, domain, RDM endpoint, tagged completion queue and
//! address vector, driven by manual progress under one lock.
//!
//! Why one endpoint: every link of every communicator shares it, so the provider sees one address
//! per process and one completion queue to poll; any thread that waits on any link drives progress
//! for all of them (a rank blocked in a send still completes its receives).
//!
//! Invariants: every libfabric call happens with `Endpoint`'s mutex held (the domain is opened with
//! FI_THREAD_DOMAIN). Each posted operation's context is an [`OpSlot`] (starting with the
//! `fi_context` FI_CONTEXT asks for) that stays at a fixed address until its completion was read;
//! progress writes the slot's atomics, links read them. A send the provider refuses with -FI_EAGAIN
//! goes to the backlog and is retried by every later progress call, before the CQ is read, in order.
//! Buffers are registered once (when the provider's mr_mode has FI_MR_LOCAL) and kept in a
//! per-size pool for reuse by later links: the registration cache.
//!
//! Device memory (FI_HMEM): when asked, the endpoint is opened with the FI_HMEM capability (and the
//! FI_MR_HMEM mode bit, which makes registering device buffers mandatory) of the same provider it
//! would use anyway, so asking never changes the provider. [`Endpoint::register`] registers any
//! memory interface with `fi_mr_regattr`, honouring the same mode bits as host buffers; keys are
//! unique per endpoint unless the provider chooses them (FI_MR_PROV_KEY).

use std::collections::{HashMap, VecDeque};
use std::ffi::{CStr, CString};
use std::os::raw::c_void;
use std::ptr;
use std::sync::atomic::{AtomicU8, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard};

use super::ofi::FABRIC_PROVIDERS;
use super::ofi_sys as sys;
use crate::error::{Error, Result};

/// Completion-queue entries (explicit size: every posted operation of every link fits with room).
const CQ_SIZE: usize = 8192;
/// Completions read per `fi_cq_read`.
const CQ_BATCH: usize = 64;

/// State of one posted operation.
pub(crate) const IDLE: u8 = 0;
pub(crate) const BUSY: u8 = 1;
pub(crate) const DONE: u8 = 2;
pub(crate) const FAILED: u8 = 3;

/// The context of one operation. `#[repr(C)]` with the provider's `fi_context` first: the provider
/// owns that part while the operation is posted.
#[repr(C)]
pub(crate) struct OpSlot {
    ctx: sys::fi_context,
    /// IDLE, BUSY, DONE or FAILED.
    pub state: AtomicU8,
    /// Bytes received (receive completions).
    pub len: AtomicUsize,
    /// Tag of the received message (receive completions).
    pub tag: AtomicU64,
    /// Why it failed (set before `state` becomes FAILED).
    pub error: Mutex<Option<String>>,
}

// SAFETY: the provider-owned `fi_context` words are only read and written by libfabric calls made
// with the endpoint's mutex held; the other fields are atomics or a mutex.
unsafe impl Send for OpSlot {}
unsafe impl Sync for OpSlot {}

impl OpSlot {
    pub(crate) fn new() -> OpSlot {
        OpSlot {
            ctx: sys::fi_context::default(),
            state: AtomicU8::new(IDLE),
            len: AtomicUsize::new(0),
            tag: AtomicU64::new(0),
            error: Mutex::new(None),
        }
    }

    fn context(&self) -> *mut c_void {
        self as *const OpSlot as *mut c_void
    }

    fn fail(&self, why: String) {
        *self.error.lock().unwrap_or_else(|e| e.into_inner()) = Some(why);
        self.state.store(FAILED, Ordering::Release);
    }

    pub(crate) fn failure(&self) -> String {
        self.error.lock().unwrap_or_else(|e| e.into_inner()).clone().unwrap_or_default()
    }
}

/// A buffer, registered with the domain when the provider requires local registration.
pub(crate) struct RegBuf {
    pub data: Vec<u8>,
    mr: *mut sys::fid_mr,
    desc: *mut c_void,
}

// SAFETY: the registration handle and descriptor are only passed to libfabric calls made with the
// endpoint's mutex held; the buffer is plain owned memory.
unsafe impl Send for RegBuf {}

/// A registration made by [`Endpoint::register`]; closed only by [`Endpoint::close_mr`].
pub(crate) struct DeviceMr {
    mr: *mut sys::fid_mr,
    /// Descriptor to pass with every operation on the registered memory.
    pub desc: *mut c_void,
}

// SAFETY: the handle and descriptor are only passed to libfabric calls made with the endpoint's
// mutex held.
unsafe impl Send for DeviceMr {}
unsafe impl Sync for DeviceMr {}

/// libfabric's name of a memory interface, for logs and errors.
pub(crate) fn iface_name(iface: sys::fi_hmem_iface) -> &'static str {
    match iface {
        sys::fi_hmem_iface_FI_HMEM_SYSTEM => "FI_HMEM_SYSTEM",
        sys::fi_hmem_iface_FI_HMEM_CUDA => "FI_HMEM_CUDA",
        sys::fi_hmem_iface_FI_HMEM_ROCR => "FI_HMEM_ROCR",
        _ => "other",
    }
}

/// A send refused with -FI_EAGAIN, to retry.
struct Backlogged {
    slot: *const OpSlot,
    buf: *const u8,
    len: usize,
    desc: *mut c_void,
    dest: u64,
    tag: u64,
}

/// Provider, domain and library version, for logs.
#[derive(Debug, Clone)]
pub struct EndpointInfo {
    pub provider: String,
    pub domain: String,
    pub fabric: String,
    pub library_version: (u32, u32),
    pub mr_mode: String,
    pub max_tag_bits: u32,
    /// Opened with FI_HMEM: device buffers may be registered and posted.
    pub hmem: bool,
}

struct Handles {
    info: *mut sys::fi_info,
    fabric: *mut sys::fid_fabric,
    domain: *mut sys::fid_domain,
    ep: *mut sys::fid_ep,
    cq: *mut sys::fid_cq,
    av: *mut sys::fid_av,
    mr_local: bool,
    mr_endpoint: bool,
    mr_prov_key: bool,
    /// Next requested key for registrations (used when the provider does not choose keys).
    next_mr_key: u64,
    peers: HashMap<Vec<u8>, u64>,
    backlog: VecDeque<Backlogged>,
    pool: HashMap<usize, Vec<RegBuf>>,
    /// A CQ error without an operation context: reported by every later wait.
    fatal: Option<String>,
}

/// The process's libfabric endpoint.
pub struct Endpoint {
    handles: Mutex<Handles>,
    name: Vec<u8>,
    info: EndpointInfo,
}

// SAFETY: the raw libfabric handles and the pointers in the backlog are only touched with the mutex
// held (FI_THREAD_DOMAIN), and the buffers they point at are owned by links that keep them alive
// until the operation completed.
unsafe impl Send for Endpoint {}
unsafe impl Sync for Endpoint {}

fn fi_error(what: &str, code: i64) -> Error {
    // SAFETY: fi_strerror returns a pointer to a static string for any code.
    let msg = unsafe { CStr::from_ptr(sys::fi_strerror((-code) as i32)) };
    Error::Fabric(format!("{what}: {} ({code})", msg.to_string_lossy()))
}

fn check(what: &str, code: i64) -> Result<()> {
    if code < 0 {
        Err(fi_error(what, code))
    } else {
        Ok(())
    }
}

/// Runtime libfabric version (major, minor).
pub fn library_version() -> (u32, u32) {
    // SAFETY: a plain query without arguments.
    let v = unsafe { sys::fi_version() };
    (v >> 16, v & 0xffff)
}

/// Queries RDM tagged providers; `provider` restricts the name (libfabric's `prov_name` syntax, e.g.
/// `tcp;ofi_rxm`). Returns the list (caller frees it with `fi_freeinfo`).
fn getinfo(provider: Option<&str>, extra_caps: u64) -> Result<*mut sys::fi_info> {
    // SAFETY: fi_allocinfo returns zeroed, owned attribute structs; we fill documented fields only,
    // and free the hints (including the strdup'ed provider name) with fi_freeinfo.
    unsafe {
        let hints = sys::mt_fi_allocinfo();
        if hints.is_null() {
            return Err(Error::Fabric("fi_allocinfo: out of memory".into()));
        }
        (*hints).caps = sys::FI_TAGGED as u64 | sys::FI_MSG as u64 | sys::FI_DIRECTED_RECV | extra_caps;
        (*hints).mode = sys::FI_CONTEXT;
        (*(*hints).ep_attr).type_ = sys::fi_ep_type_FI_EP_RDM;
        let dom = &mut *(*hints).domain_attr;
        dom.threading = sys::fi_threading_FI_THREAD_DOMAIN;
        dom.control_progress = sys::fi_progress_FI_PROGRESS_MANUAL;
        dom.data_progress = sys::fi_progress_FI_PROGRESS_MANUAL;
        dom.av_type = sys::fi_av_type_FI_AV_TABLE;
        // Every mode bit we can honour: LOCAL (register and pass descriptors), ENDPOINT (bind and
        // enable each MR), ALLOCATED (buffers exist before registration), VIRT_ADDR and PROV_KEY
        // (only matter to remote access, which tagged messaging never does).
        dom.mr_mode = (sys::FI_MR_LOCAL
            | sys::FI_MR_ENDPOINT
            | sys::FI_MR_ALLOCATED
            | sys::FI_MR_VIRT_ADDR
            | sys::FI_MR_PROV_KEY) as i32;
        if extra_caps & sys::FI_HMEM != 0 {
            dom.mr_mode |= sys::FI_MR_HMEM as i32;
        }
        if let Some(p) = provider {
            let c = CString::new(p).map_err(|_| Error::config("FI_PROVIDER", "contains NUL"))?;
            (*(*hints).fabric_attr).prov_name = libc::strdup(c.as_ptr());
        }
        let mut list = ptr::null_mut();
        let rc = sys::fi_getinfo(sys::mt_fi_api_version(), ptr::null(), ptr::null(), 0, hints, &mut list);
        sys::fi_freeinfo(hints);
        check(&format!("fi_getinfo (provider {})", provider.unwrap_or("any")), rc as i64)?;
        Ok(list)
    }
}

fn cstr(p: *const std::os::raw::c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    // SAFETY: libfabric's name fields are NUL-terminated strings owned by the info list.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

impl Endpoint {
    /// Opens an endpoint on the first provider matching `provider`; when a fabric provider offers
    /// several domains (NICs), on domain number `local_rank % domains` so that ranks of one node
    /// spread over them. With `want_hmem`, the same provider's FI_HMEM variant where it offers one.
    pub fn open(provider: Option<&str>, local_rank: usize, want_hmem: bool) -> Result<Endpoint> {
        let list = getinfo(provider, 0)?;
        let mut hmem_list = ptr::null_mut();
        if want_hmem && !list.is_null() {
            // SAFETY: reading the first entry of the list fi_getinfo returned.
            let first = cstr(unsafe { (*(*list).fabric_attr).prov_name });
            hmem_list = getinfo(Some(&first), sys::FI_HMEM).unwrap_or(ptr::null_mut());
        }
        let result = match hmem_list.is_null() {
            true => Self::open_from(list, local_rank, false),
            false => Self::open_from(hmem_list, local_rank, true),
        };
        // SAFETY: the chosen entry was duplicated; the lists themselves are no longer used.
        unsafe {
            sys::fi_freeinfo(list);
            if !hmem_list.is_null() {
                sys::fi_freeinfo(hmem_list);
            }
        }
        result
    }

    fn open_from(list: *mut sys::fi_info, local_rank: usize, hmem: bool) -> Result<Endpoint> {
        // Entries of the first (preferred) provider, one per domain.
        let mut entries = Vec::new();
        let mut cur = list;
        while !cur.is_null() {
            // SAFETY: walking the list fi_getinfo returned.
            unsafe {
                let prov = cstr((*(*cur).fabric_attr).prov_name);
                let dom = cstr((*(*cur).domain_attr).name);
                let first = entries.first().map(|&(p, _, _): &(*mut sys::fi_info, String, String)| p);
                let first_prov = first.map(|f| cstr((*(*f).fabric_attr).prov_name));
                if first_prov.as_deref().is_none_or(|p| p == prov) && !entries.iter().any(|e| e.2 == dom) {
                    entries.push((cur, prov, dom));
                }
                cur = (*cur).next;
            }
        }
        // Several domains of a fabric provider are NICs: ranks of a node spread over them. Other
        // providers list network interfaces (loopback among them): those use the preferred one.
        let nic = match entries.first() {
            Some((_, prov, _)) if FABRIC_PROVIDERS.iter().any(|f| prov.split(';').any(|q| q == *f)) => local_rank,
            _ => 0,
        };
        let Some(&(chosen, _, _)) = entries.get(nic % entries.len().max(1)) else {
            return Err(Error::Fabric("fi_getinfo returned no provider".into()));
        };
        // SAFETY: every call below gets handles created just before; failures return before use and
        // the partially built Handles is closed by its Drop.
        unsafe {
            let info = sys::fi_dupinfo(chosen);
            let mut h = Handles {
                info,
                fabric: ptr::null_mut(),
                domain: ptr::null_mut(),
                ep: ptr::null_mut(),
                cq: ptr::null_mut(),
                av: ptr::null_mut(),
                mr_local: false,
                mr_endpoint: false,
                mr_prov_key: false,
                next_mr_key: 1,
                peers: HashMap::new(),
                backlog: VecDeque::new(),
                pool: HashMap::new(),
                fatal: None,
            };
            let dom = &*(*info).domain_attr;
            h.mr_local = dom.mr_mode as u64 & sys::FI_MR_LOCAL as u64 != 0 || (*info).mode & sys::FI_LOCAL_MR != 0;
            h.mr_endpoint = dom.mr_mode as u64 & sys::FI_MR_ENDPOINT as u64 != 0;
            h.mr_prov_key = dom.mr_mode as u64 & sys::FI_MR_PROV_KEY as u64 != 0;
            let mut fabric = ptr::null_mut();
            check("fi_fabric", sys::fi_fabric((*info).fabric_attr, &mut fabric, ptr::null_mut()) as i64)?;
            h.fabric = fabric;
            check("fi_domain", sys::mt_fi_domain(h.fabric, info, &mut h.domain) as i64)?;
            let mut cq_attr = sys::fi_cq_attr {
                size: CQ_SIZE,
                format: sys::fi_cq_format_FI_CQ_FORMAT_TAGGED,
                wait_obj: sys::fi_wait_obj_FI_WAIT_NONE,
                ..Default::default()
            };
            check("fi_cq_open", sys::mt_fi_cq_open(h.domain, &mut cq_attr, &mut h.cq) as i64)?;
            let mut av_attr = sys::fi_av_attr { type_: sys::fi_av_type_FI_AV_TABLE, ..Default::default() };
            check("fi_av_open", sys::mt_fi_av_open(h.domain, &mut av_attr, &mut h.av) as i64)?;
            check("fi_endpoint", sys::mt_fi_endpoint(h.domain, info, &mut h.ep) as i64)?;
            check("fi_ep_bind(cq)", sys::mt_fi_ep_bind(h.ep, &mut (*h.cq).fid, (sys::FI_TRANSMIT | sys::FI_RECV) as u64) as i64)?;
            check("fi_ep_bind(av)", sys::mt_fi_ep_bind(h.ep, &mut (*h.av).fid, 0) as i64)?;
            check("fi_enable", sys::mt_fi_enable(h.ep) as i64)?;
            let mut name = vec![0u8; 256];
            let mut len = name.len();
            check("fi_getname", sys::mt_fi_getname(h.ep, name.as_mut_ptr() as *mut c_void, &mut len) as i64)?;
            name.truncate(len);
            let mr_bits = dom.mr_mode as u64;
            let names = [
                (sys::FI_MR_LOCAL, "LOCAL"),
                (sys::FI_MR_ENDPOINT, "ENDPOINT"),
                (sys::FI_MR_ALLOCATED, "ALLOCATED"),
                (sys::FI_MR_VIRT_ADDR, "VIRT_ADDR"),
                (sys::FI_MR_PROV_KEY, "PROV_KEY"),
                (sys::FI_MR_HMEM, "HMEM"),
            ];
            let mr_mode: Vec<&str> = names.iter().filter(|(b, _)| mr_bits & *b as u64 != 0).map(|(_, n)| *n).collect();
            let info_out = EndpointInfo {
                provider: cstr((*(*info).fabric_attr).prov_name),
                domain: cstr(dom.name),
                fabric: cstr((*(*info).fabric_attr).name),
                library_version: library_version(),
                mr_mode: if mr_mode.is_empty() { "none".into() } else { mr_mode.join("|") },
                // A format of 0 leaves the tag layout to the provider: all 64 bits match.
                max_tag_bits: match (*(*info).ep_attr).mem_tag_format {
                    0 => 64,
                    f => 64 - f.leading_zeros(),
                },
                hmem,
            };
            Ok(Endpoint { handles: Mutex::new(h), name, info: info_out })
        }
    }

    /// This endpoint's address, to send to peers.
    pub fn name(&self) -> &[u8] {
        &self.name
    }

    pub fn info(&self) -> &EndpointInfo {
        &self.info
    }

    fn lock(&self) -> MutexGuard<'_, Handles> {
        self.handles.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Inserts a peer's address (once per address) and returns its `fi_addr_t`.
    pub fn insert_peer(&self, name: &[u8]) -> Result<u64> {
        let mut h = self.lock();
        if let Some(&a) = h.peers.get(name) {
            return Ok(a);
        }
        let mut addr = 0u64;
        // SAFETY: `name` is a peer address of the same provider (the caller checked its length); the
        // AV copies it.
        let n = unsafe { sys::mt_fi_av_insert(h.av, name.as_ptr() as *const c_void, &mut addr) };
        if n != 1 {
            return Err(Error::Fabric(format!("fi_av_insert: inserted {n} of 1 addresses")));
        }
        h.peers.insert(name.to_vec(), addr);
        Ok(addr)
    }

    /// A buffer of `len` bytes from the registration cache, or newly allocated and registered.
    pub fn take_buffer(&self, len: usize) -> Result<RegBuf> {
        let mut h = self.lock();
        if let Some(b) = h.pool.get_mut(&len).and_then(|v| v.pop()) {
            return Ok(b);
        }
        let data = vec![0u8; len];
        let (mut mr, mut desc) = (ptr::null_mut(), ptr::null_mut());
        if h.mr_local {
            // `data` is allocated (FI_MR_ALLOCATED) and stays at this address until the
            // registration is closed (the Vec is never resized; RegBuf owns both).
            (mr, desc) = h.register(data.as_ptr(), len, sys::fi_hmem_iface_FI_HMEM_SYSTEM, 0)?;
        }
        Ok(RegBuf { data, mr, desc })
    }

    /// Registers `len` bytes at `addr` of memory interface `iface` (`device`: the CUDA ordinal)
    /// for local sends and receives; returns the registration and its descriptor. The caller
    /// keeps the memory allocated until it passes the registration to [`Endpoint::close_mr`].
    pub fn register(&self, addr: *const u8, len: usize, iface: sys::fi_hmem_iface, device: i32) -> Result<DeviceMr> {
        let (mr, desc) = self.lock().register(addr, len, iface, device)?;
        Ok(DeviceMr { mr, desc })
    }

    /// Closes a registration made by [`Endpoint::register`].
    pub fn close_mr(&self, mr: DeviceMr) {
        let _h = self.lock();
        // SAFETY: the registration was made on this domain and no operation posted with its
        // descriptor is outstanding (the direct path waits for every one before returning).
        unsafe { sys::mt_fi_close(&mut (*mr.mr).fid) };
    }

    /// Returns a buffer to the registration cache.
    pub fn give_back(&self, buf: RegBuf) {
        self.lock().pool.entry(buf.data.len()).or_default().push(buf);
    }

    /// Posts a tagged send of `buf[..len]` to `dest`; a full queue puts it in the backlog.
    pub fn send(&self, slot: &OpSlot, buf: &RegBuf, len: usize, dest: u64, tag: u64) -> Result<()> {
        self.send_raw(slot, buf.data.as_ptr(), len, buf.desc, dest, tag)
    }

    /// Posts a tagged send of `len` bytes at `buf` (registered with descriptor `desc`, or null
    /// where the provider needs none) to `dest`; the memory stays valid until `slot` completes.
    pub fn send_raw(&self, slot: &OpSlot, buf: *const u8, len: usize, desc: *mut c_void, dest: u64, tag: u64) -> Result<()> {
        slot.state.store(BUSY, Ordering::Release);
        let mut h = self.lock();
        let item = Backlogged { slot, buf, len, desc, dest, tag };
        if !h.backlog.is_empty() {
            h.backlog.push_back(item);
            return Ok(());
        }
        match h.try_send(&item) {
            Ok(true) => Ok(()),
            Ok(false) => {
                h.backlog.push_back(item);
                Ok(())
            }
            Err(e) => {
                slot.state.store(IDLE, Ordering::Release);
                Err(e)
            }
        }
    }

    /// Posts a tagged receive into `buf` for a message from `src` with exactly `tag`.
    pub fn recv(&self, slot: &OpSlot, buf: &mut RegBuf, src: u64, tag: u64) -> Result<()> {
        let len = buf.data.len();
        self.recv_raw(slot, buf.data.as_mut_ptr(), len, buf.desc, src, tag)
    }

    /// Posts a tagged receive of at most `len` bytes into `buf` (descriptor `desc`) for a message
    /// from `src` with exactly `tag`; the memory stays valid until `slot` completes.
    pub fn recv_raw(&self, slot: &OpSlot, buf: *mut u8, len: usize, desc: *mut c_void, src: u64, tag: u64) -> Result<()> {
        slot.state.store(BUSY, Ordering::Release);
        let h = self.lock();
        loop {
            // SAFETY: the buffer and slot stay alive and in place until the completion is read (the
            // link cancels and drains before freeing them).
            let rc = unsafe {
                sys::mt_fi_trecv(h.ep, buf as *mut c_void, len, desc, src, tag, slot.context())
            };
            if rc == -(sys::FI_EAGAIN as isize) {
                h.progress_locked_read();
                continue;
            }
            if rc < 0 {
                slot.state.store(IDLE, Ordering::Release);
            }
            return check("fi_trecv", rc as i64);
        }
    }

    /// Asks the provider to cancel a posted receive (it completes with FI_ECANCELED, or normally).
    pub fn cancel(&self, slot: &OpSlot) {
        let h = self.lock();
        // SAFETY: cancelling by context; unknown contexts are ignored by the provider.
        unsafe { sys::mt_fi_cancel(h.ep, slot.context()) };
    }

    /// One round of manual progress: retries backlogged sends, then reads completions (and errors).
    /// Returns an endpoint-level failure, if one happened.
    pub fn progress(&self) -> Result<()> {
        let mut h = self.lock();
        while let Some(item) = h.backlog.front() {
            let item = Backlogged { ..*item };
            match h.try_send(&item) {
                Ok(true) => {
                    h.backlog.pop_front();
                }
                Ok(false) => break,
                Err(e) => {
                    h.backlog.pop_front();
                    // SAFETY: the slot outlives its operation (see `send`).
                    unsafe { &*item.slot }.fail(e.to_string());
                }
            }
        }
        if let Some(why) = h.progress_locked_read() {
            h.fatal.get_or_insert(why);
        }
        match &h.fatal {
            Some(why) => Err(Error::Fabric(why.clone())),
            None => Ok(()),
        }
    }
}

impl Handles {
    /// Registers memory (see [`Endpoint::register`]) honouring FI_MR_ENDPOINT (bind, enable) and
    /// FI_MR_PROV_KEY (else a key unique on this endpoint is requested).
    fn register(&mut self, addr: *const u8, len: usize, iface: sys::fi_hmem_iface, device: i32) -> Result<(*mut sys::fid_mr, *mut c_void)> {
        let access = (sys::FI_SEND | sys::FI_RECV) as u64;
        let key = if self.mr_prov_key { 0 } else { self.next_mr_key };
        self.next_mr_key += 1;
        let mut mr = ptr::null_mut();
        // SAFETY: the caller keeps [addr, addr + len) allocated until the registration is closed.
        unsafe {
            let rc = sys::mt_fi_mr_regattr(self.domain, addr as *const c_void, len, access, key, iface as i32, device, &mut mr);
            check(&format!("fi_mr_regattr ({len} bytes, iface {})", iface_name(iface)), rc as i64)?;
            if self.mr_endpoint {
                let bound = check("fi_mr_bind", sys::mt_fi_mr_bind_ep(mr, self.ep) as i64)
                    .and_then(|_| check("fi_mr_enable", sys::mt_fi_mr_enable(mr) as i64));
                if let Err(e) = bound {
                    sys::mt_fi_close(&mut (*mr).fid);
                    return Err(e);
                }
            }
            Ok((mr, sys::mt_fi_mr_desc(mr)))
        }
    }

    /// Ok(true) posted, Ok(false) the provider said -FI_EAGAIN.
    fn try_send(&self, item: &Backlogged) -> Result<bool> {
        // SAFETY: see `Endpoint::send`: buffer and slot stay alive until the completion is read.
        let rc = unsafe {
            sys::mt_fi_tsend(self.ep, item.buf as *const c_void, item.len, item.desc, item.dest, item.tag, (*item.slot).context())
        };
        if rc == -(sys::FI_EAGAIN as isize) {
            return Ok(false);
        }
        check("fi_tsend", rc as i64).map(|_| true)
    }

    /// Reads every available completion into its slot; returns an error not tied to any operation.
    fn progress_locked_read(&self) -> Option<String> {
        let mut entries = [sys::fi_cq_tagged_entry::default(); CQ_BATCH];
        loop {
            // SAFETY: reading into a local array of CQ_BATCH tagged entries (the CQ's format).
            let n = unsafe { sys::mt_fi_cq_read(self.cq, entries.as_mut_ptr(), CQ_BATCH) };
            if n > 0 {
                for e in &entries[..n as usize] {
                    // SAFETY: every operation we post carries an OpSlot as its context, alive
                    // until this completion is consumed.
                    let slot = unsafe { &*(e.op_context as *const OpSlot) };
                    slot.len.store(e.len, Ordering::Relaxed);
                    slot.tag.store(e.tag, Ordering::Relaxed);
                    slot.state.store(DONE, Ordering::Release);
                }
                continue;
            }
            if n == -(sys::FI_EAVAIL as isize) {
                let mut err = sys::fi_cq_err_entry::default();
                // SAFETY: reading one error entry into a local struct.
                if unsafe { sys::mt_fi_cq_readerr(self.cq, &mut err) } < 0 {
                    return None;
                }
                // SAFETY: fi_cq_strerror returns a string owned by the provider or a static one.
                let prov = cstr(unsafe { sys::mt_fi_cq_strerror(self.cq, err.prov_errno, err.err_data) });
                // SAFETY: static string for any code.
                let msg = cstr(unsafe { sys::fi_strerror(err.err) });
                let why = format!("completion error: {msg} (provider: {prov})");
                if err.op_context.is_null() {
                    return Some(why);
                }
                // SAFETY: as for normal completions.
                let slot = unsafe { &*(err.op_context as *const OpSlot) };
                slot.len.store(err.len, Ordering::Relaxed);
                slot.fail(why);
                continue;
            }
            // -FI_EAGAIN: nothing more now.
            return if n < 0 && n != -(sys::FI_EAGAIN as isize) {
                Some(fi_error("fi_cq_read", n as i64).to_string())
            } else {
                None
            };
        }
    }
}

impl Drop for Handles {
    fn drop(&mut self) {
        // SAFETY: closing in reverse order of creation; null handles were never opened. Links hold
        // an Arc of the endpoint, so no operation is posted any more.
        unsafe {
            for buf in self.pool.drain().flat_map(|(_, v)| v) {
                if !buf.mr.is_null() {
                    sys::mt_fi_close(&mut (*buf.mr).fid);
                }
            }
            if !self.ep.is_null() {
                sys::mt_fi_close(&mut (*self.ep).fid);
            }
            if !self.av.is_null() {
                sys::mt_fi_close(&mut (*self.av).fid);
            }
            if !self.cq.is_null() {
                sys::mt_fi_close(&mut (*self.cq).fid);
            }
            if !self.domain.is_null() {
                sys::mt_fi_close(&mut (*self.domain).fid);
            }
            if !self.fabric.is_null() {
                sys::mt_fi_close(&mut (*self.fabric).fid);
            }
            if !self.info.is_null() {
                sys::fi_freeinfo(self.info);
            }
        }
    }
}
