//! Python classes `BlockPool` and `SlotPool` (standalone, or a view of a ledger's pool), and the
//! macros that forward a binding to the core.

use std::sync::{Arc, Mutex};

use disagg_core::{BlockPool, DisaggError, ImportLedger, PinLedger, SlotPool, SlotState};
use numpy::PyReadonlyArray1;
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::types::PyList;

use crate::args::{Id, Ids, Int, IntList, Kind, U64s, U32};
use crate::error::IntoPyResult;

/// Lock a shared core object; a poisoned lock becomes a Python error.
pub fn lock<T>(m: &Mutex<T>) -> PyResult<std::sync::MutexGuard<'_, T>> {
    m.lock().map_err(|_| {
        PyRuntimeError::new_err("disagg_rs internal lock poisoned by an earlier panic")
    })
}

/// What a core call returns, as Python receives it.
pub trait Out {
    type Py;
    /// Convert, mapping a core error through the one error mapping.
    fn out(self) -> PyResult<Self::Py>;
}

/// A core error goes through the one error mapping; the value converts as it does bare.
impl<T: Out> Out for Result<T, DisaggError> {
    type Py = T::Py;
    fn out(self) -> PyResult<T::Py> {
        self.py()?.out()
    }
}

/// `Out` for values Python receives as they are.
macro_rules! plain_out {
    ($($t:ty),*) => {$(
        impl Out for $t {
            type Py = $t;
            fn out(self) -> PyResult<$t> {
                Ok(self)
            }
        }
    )*};
}
plain_out!((), bool, u32, u64, Option<u64>, Option<&'static str>, Vec<u32>, Vec<u64>);
plain_out!(Vec<(u64, u64)>, Vec<(u64, bool)>, String, usize, &'static str, Option<String>);
plain_out!(
    Option<(u64, Vec<u64>)>,
    Vec<(usize, usize)>,
    (bool, bool, Vec<(usize, usize)>),
    Vec<(usize, usize, u64, [u64; 4])>,
    Vec<usize>,
    std::collections::BTreeMap<u64, String>,
    i64,
    (i64, &'static str),
    (bool, bool, bool),
    Vec<[u64; 4]>,
    Option<Vec<u32>>,
    Option<u32>,
    Vec<(String, Vec<u64>)>,
    Vec<(&'static str, (u32, u32), (u32, u32))>,
    (&'static str, u64),
    (i64, Vec<u64>),
    Vec<i64>,
    (Option<u64>, Option<u64>)
);
plain_out!((bool, u64), (u64, u64), (i64, bool), (u64, u64, u64));

/// `Out` converting a core value: `CoreType => PyType = |v| expr;` (`expr` may use `?`).
macro_rules! outs {
    ($($t:ty => $py:ty = |$v:ident| $e:expr;)*) => {$(
        impl $crate::pool::Out for $t {
            type Py = $py;
            fn out(self) -> ::pyo3::PyResult<$py> {
                let $v = self;
                Ok($e)
            }
        }
    )*};
}
pub(crate) use outs;

outs! {
    SlotState => &'static str = |v| v.name();
}

/// One `#[pymethods]` block of a class reaching its core object as `reach(&self.field, f)`:
/// each `calls` entry `fn name(arg: Conv, ..) -> T = method(exprs..).then..` converts its
/// arguments ([`Conv`](crate::args::Conv)) before the lock, then returns `core.method(..)`
/// (followed by `.then` method calls or fields) through [`Out`]; `ctors { #[new] fn name(arg:
/// Conv, ..) = expr; }` build the class with `expr` as its `field`; `statics { fn name(..) ->
/// T = expr; }` are static methods returning `expr` through [`Out`]; `methods { .. }` holds
/// the hand-written ones; `pools Variant,` adds the `block_pool` and `slot_pool` views of a
/// ledger's pools.
macro_rules! core_methods {
    (
        $ty:ty, $reach:path, $field:tt, $(pools $owner:ident,)?
        $(ctors { $($(#[$cm:meta])* fn $cn:ident($($ca:ident: $cc:ty),*) = $ce:expr;)* })?
        calls { $($(#[$m:meta])* fn $name:ident($($a:ident: $c:ty),*) -> $ret:ty
            = $call:ident($($x:expr),*) $(.$then:ident $(($($y:expr),*))?)*;)* }
        $(statics { $($(#[$sm:meta])* fn $sn:ident($($sa:ident: $sc:ty),*) -> $sr:ty
            = $se:expr;)* })?
        methods { $($rest:tt)* }
    ) => {
        #[pymethods]
        impl $ty {
            $($($(#[$cm])*
            fn $cn($($ca: <$cc as $crate::args::Conv>::Py),*) -> PyResult<Self> {
                $crate::args::conv!($($ca: $cc),*);
                Ok(Self { $field: $ce })
            })*)?
            $($(#[$m])*
            fn $name(&self, $($a: <$c as $crate::args::Conv>::Py),*) -> PyResult<$ret> {
                $crate::args::conv!($($a: $c),*);
                let r = $reach(&self.$field, |c| c.$call($($x),*)$(.$then $(($($y),*))?)*)?;
                $crate::pool::Out::out(r)
            })*
            $($($(#[$sm])*
            #[staticmethod]
            fn $sn($($sa: <$sc as $crate::args::Conv>::Py),*) -> PyResult<$sr> {
                $crate::args::conv!($($sa: $sc),*);
                $crate::pool::Out::out($se)
            })*)?
            $(
                /// The ledger's block pool (shared, not a copy): the engine's allocator.
                #[getter]
                fn block_pool(&self) -> $crate::pool::PyBlockPool {
                    let owner = $crate::pool::PoolOwner::$owner(self.$field.clone());
                    $crate::pool::PyBlockPool { owner }
                }
                /// The ledger's SSM slot pool (shared, not a copy).
                #[getter]
                fn slot_pool(&self) -> $crate::pool::PySlotPool {
                    let owner = $crate::pool::PoolOwner::$owner(self.$field.clone());
                    $crate::pool::PySlotPool { owner }
                }
            )?
            $($rest)*
        }
    };
}
pub(crate) use core_methods;

/// `#[pyfunction]`s forwarding to the core: `fn name(arg: Conv, ..) -> T = expr;` converts
/// the arguments ([`Conv`](crate::args::Conv)), then returns `expr` through [`Out`].
macro_rules! core_fns {
    ($($(#[$m:meta])* fn $name:ident($($a:ident: $c:ty),*) -> $ret:ty = $e:expr;)*) => {$(
        #[::pyo3::pyfunction]
        $(#[$m])*
        pub fn $name($($a: <$c as $crate::args::Conv>::Py),*) -> ::pyo3::PyResult<$ret> {
            $crate::args::conv!($($a: $c),*);
            $crate::pool::Out::out($e)
        }
    )*};
}
pub(crate) use core_fns;

/// Run `f` on the core object behind `m`, locked.
pub fn lock_with<T, R>(m: &Mutex<T>, f: impl FnOnce(&mut T) -> R) -> PyResult<R> {
    Ok(f(&mut *lock(m)?))
}

/// Token ids from a list or a 1-D integer numpy array read directly (the generic sequence path
/// costs more than hashing them), or any sequence.
pub fn tokens_arg(obj: &Bound<'_, PyAny>) -> PyResult<Vec<i64>> {
    if let Ok(list) = obj.cast::<PyList>() {
        let mut out = Vec::with_capacity(list.len());
        for (i, item) in list.iter().enumerate() {
            out.push(disagg_core::args::token(i, &item.extract::<Int>()?.0).py()?);
        }
        return Ok(out);
    }
    if let Ok(arr) = obj.extract::<PyReadonlyArray1<'_, i64>>() {
        return Ok(arr.as_array().to_vec());
    }
    if let Ok(arr) = obj.extract::<PyReadonlyArray1<'_, i32>>() {
        return Ok(arr.as_array().iter().map(|&t| i64::from(t)).collect());
    }
    obj.extract::<IntList>()?.to_i64s(Kind::Argument, "prompt_tokens")
}

/// Who owns the pool a `BlockPool` or `SlotPool` object talks to: itself, or a ledger.
pub enum PoolOwner<P> {
    Own(Arc<Mutex<P>>),
    Import(Arc<Mutex<ImportLedger>>),
    Pin(Arc<Mutex<PinLedger>>),
}

/// A pool a ledger owns, reached the same way through either ledger.
pub trait LedgerPool: Sized {
    fn of_import(l: &mut ImportLedger) -> &mut Self;
    fn of_pin(l: &mut PinLedger) -> &mut Self;
}

macro_rules! ledger_pool {
    ($($pool:ty => $get:ident),*) => {$(
        impl LedgerPool for $pool {
            fn of_import(l: &mut ImportLedger) -> &mut Self { l.$get() }
            fn of_pin(l: &mut PinLedger) -> &mut Self { l.$get() }
        }
    )*};
}
ledger_pool!(BlockPool => pool_mut, SlotPool => slots_mut);

impl<P> From<P> for PoolOwner<P> {
    fn from(pool: P) -> Self {
        Self::Own(Arc::new(Mutex::new(pool)))
    }
}

impl<P: LedgerPool> PoolOwner<P> {
    /// Run `f` on the pool, locked.
    pub fn with<R>(&self, f: impl FnOnce(&mut P) -> R) -> PyResult<R> {
        Ok(match self {
            Self::Own(m) => f(&mut *lock(m)?),
            Self::Import(m) => f(P::of_import(&mut *lock(m)?)),
            Self::Pin(m) => f(P::of_pin(&mut *lock(m)?)),
        })
    }
}

/// The pool classes, each over a [`PoolOwner`] (standalone, or a view of a ledger's pool):
/// `"Name" PyName = Pool::make(arg: Conv, ..)` then the `calls` and `methods` of
/// [`core_methods`] beyond those every pool has (constructor, `check`, `__repr__`).
macro_rules! pool_classes {
    ($($(#[$doc:meta])* $name:literal $py:ident = $pool:ident::$make:ident($($a:ident: $c:ty),*)
        calls { $($calls:tt)* } methods { $($methods:tt)* })*) => {$(
        $(#[$doc])*
        #[pyclass(name = $name, module = "disagg_rs", frozen)]
        pub struct $py {
            pub owner: PoolOwner<$pool>,
        }

        core_methods!($py, PoolOwner::with, owner,
        ctors {
            #[new]
            fn new($($a: $c),*) = $pool::$make($($a),*).py()?.into();
        }
        calls {
            /// Verify conservation; raises `ConservationError`.
            fn check() -> () = check();
            fn __repr__() -> String = to_string();
            $($calls)*
        }
        methods { $($methods)* });
    )*};
}

pool_classes! {
/// Fixed pool of KV blocks: refcounts, prefix cache by block hash, LRU eviction.
"BlockPool" PyBlockPool = BlockPool::new(num_blocks: U32, block_size_tokens: U32)
calls {
    #[getter] fn num_blocks() -> u32 = num_blocks();
    #[getter] fn block_size_tokens() -> u32 = block_size_tokens();
    /// Blocks `allocate` can hand out now (never-used plus evictable cached).
    #[getter] fn num_free() -> u32 = num_free();
    /// Unreferenced blocks still published in the prefix cache.
    #[getter] fn num_evictable() -> u32 = num_evictable();
    /// Whether `allocate(n)` would succeed now.
    fn can_allocate(n: U32) -> bool = can_allocate(n);
    /// `n` blocks with refcount 1, all or nothing (evicts LRU cached blocks if needed).
    fn allocate(n: U32) -> Vec<u32> = allocate(n);
    fn refcount(block_id: Id) -> u32 = refcount(block_id);
    /// One more reference per occurrence; claims evictable cached blocks.
    fn retain(block_ids: Ids) -> () = retain(&block_ids);
    /// One reference less per occurrence; all or nothing.
    fn release(block_ids: Ids) -> () = release(&block_ids);
    /// Publish held full blocks under their hashes.
    fn register_cached(block_ids: Ids, hashes: U64s) -> () = register_cached(&block_ids, &hashes);
    /// Blocks of the longest cached prefix of `hashes` (not retained).
    fn match_prefix(hashes: U64s) -> Vec<u32> = match_prefix(&hashes);
}
methods {
    fn __len__(&self) -> PyResult<usize> {
        self.owner.with(|p| p.num_blocks() as usize)
    }

    /// Hash chain over the full blocks of `tokens` (deterministic across processes).
    fn block_hashes(&self, py: Python<'_>, tokens: &Bound<'_, PyAny>) -> PyResult<Vec<u64>> {
        let tokens = tokens_arg(tokens)?;
        let bs = self.owner.with(|p| p.block_size_tokens())?;
        py.detach(|| disagg_core::block_hashes(&tokens, bs)).py()
    }
}

/// Fixed pool of SSM state slots.
"SlotPool" PySlotPool = SlotPool::try_new(num_slots: U32)
calls {
    #[getter] fn num_slots() -> u32 = num_slots();
    /// Slots ready to hand out.
    #[getter] fn num_free() -> u32 = num_free();
    /// Slots moved to live requests by `detach`.
    #[getter] fn num_detached() -> u32 = num_detached();
    /// One free slot; `CapacityError` when none is free.
    fn allocate() -> u32 = allocate();
    fn free(slot: Id) -> () = free(slot);
    /// Move an allocated slot to a live request, whose owner later calls `free`.
    fn detach(slot: Id) -> () = detach(slot);
    /// `"free"`, `"allocated"` or `"detached"`.
    fn state(slot: Id) -> &'static str = state(slot);
}
methods {}
}
