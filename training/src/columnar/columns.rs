//! Arrow columns of the flat layout: one kind per Rust type of a [`super::flat::Flat`]
//! field, each knowing its Arrow type, whether it may be null, how to build a column from
//! the rows and how to read one back.

use std::marker::PhantomData;
use std::sync::Arc;

use arrow_array::builder::{ListBuilder, UInt32Builder};
use arrow_array::types::{Float64Type, Int32Type, UInt32Type, UInt64Type, UInt8Type};
use arrow_array::{
    Array, ArrayRef, ArrowPrimitiveType, BooleanArray, ListArray, PrimitiveArray, RecordBatch,
    StringArray,
};

/// How one column is written and read. `get` gives the whole column, one value per row, or
/// says what is wrong with it (the caller names the file and the column).
pub(super) trait Kind {
    /// The value of one row.
    type Value: Default;
    /// Whether the column may hold nulls.
    const NULLABLE: bool;
    /// The column of `values`.
    fn array<'a>(values: impl Iterator<Item = &'a Self::Value>) -> ArrayRef
    where
        Self::Value: 'a;
    /// The column `name` of `batch`.
    fn get(batch: &RecordBatch, name: &str) -> Result<Vec<Self::Value>, String>;
}

/// A column that may hold nulls, of Arrow type `T`.
pub(super) struct Opt<T>(PhantomData<T>);
/// A column without nulls, of Arrow type `T`.
pub(super) struct Req<T>(PhantomData<T>);
/// Text, never null.
pub(super) struct Text;
/// Text or null.
pub(super) struct OptText;
/// A boolean, never null.
pub(super) struct Flag;
/// A list of process ids, or null.
pub(super) struct Pids;

pub(super) type OptF64 = Opt<Float64Type>;
pub(super) type OptU8 = Opt<UInt8Type>;
pub(super) type OptU32 = Opt<UInt32Type>;
pub(super) type OptU64 = Opt<UInt64Type>;
pub(super) type F64 = Req<Float64Type>;
pub(super) type I32 = Req<Int32Type>;
pub(super) type U32 = Req<UInt32Type>;
pub(super) type U64 = Req<UInt64Type>;

fn column<'b, A: 'static>(batch: &'b RecordBatch, name: &str) -> Result<&'b A, String> {
    let c = batch
        .column_by_name(name)
        .ok_or_else(|| "missing".to_string())?;
    c.as_any()
        .downcast_ref::<A>()
        .ok_or_else(|| format!("of type {}, not the one this build writes", c.data_type()))
}

fn no_nulls(a: &dyn Array) -> Result<(), String> {
    if a.null_count() > 0 {
        return Err(format!(
            "{} null value(s) in a column that has none",
            a.null_count()
        ));
    }
    Ok(())
}

impl<T: ArrowPrimitiveType> Kind for Opt<T> {
    type Value = Option<T::Native>;
    const NULLABLE: bool = true;
    fn array<'a>(values: impl Iterator<Item = &'a Self::Value>) -> ArrayRef {
        Arc::new(values.copied().collect::<PrimitiveArray<T>>())
    }
    /// A nullable column a file lacks reads as nulls: the file was written by a layout
    /// before the column was added (columns are only ever added nullable).
    fn get(batch: &RecordBatch, name: &str) -> Result<Vec<Self::Value>, String> {
        if batch.column_by_name(name).is_none() {
            return Ok(vec![None; batch.num_rows()]);
        }
        Ok(column::<PrimitiveArray<T>>(batch, name)?.iter().collect())
    }
}

impl<T: ArrowPrimitiveType> Kind for Req<T> {
    type Value = T::Native;
    const NULLABLE: bool = false;
    fn array<'a>(values: impl Iterator<Item = &'a Self::Value>) -> ArrayRef {
        Arc::new(PrimitiveArray::<T>::from_iter_values(values.copied()))
    }
    fn get(batch: &RecordBatch, name: &str) -> Result<Vec<Self::Value>, String> {
        let a = column::<PrimitiveArray<T>>(batch, name)?;
        no_nulls(a)?;
        Ok(a.values().to_vec())
    }
}

impl Kind for Text {
    type Value = String;
    const NULLABLE: bool = false;
    fn array<'a>(values: impl Iterator<Item = &'a Self::Value>) -> ArrayRef {
        Arc::new(StringArray::from_iter_values(values))
    }
    fn get(batch: &RecordBatch, name: &str) -> Result<Vec<Self::Value>, String> {
        let a = column::<StringArray>(batch, name)?;
        no_nulls(a)?;
        Ok(a.iter()
            .map(|v| v.unwrap_or_default().to_string())
            .collect())
    }
}

impl Kind for OptText {
    type Value = Option<String>;
    const NULLABLE: bool = true;
    fn array<'a>(values: impl Iterator<Item = &'a Self::Value>) -> ArrayRef {
        Arc::new(values.map(Option::as_deref).collect::<StringArray>())
    }
    fn get(batch: &RecordBatch, name: &str) -> Result<Vec<Self::Value>, String> {
        let a = column::<StringArray>(batch, name)?;
        Ok(a.iter().map(|v| v.map(str::to_string)).collect())
    }
}

impl Kind for Flag {
    type Value = bool;
    const NULLABLE: bool = false;
    fn array<'a>(values: impl Iterator<Item = &'a Self::Value>) -> ArrayRef {
        Arc::new(values.map(|v| Some(*v)).collect::<BooleanArray>())
    }
    fn get(batch: &RecordBatch, name: &str) -> Result<Vec<Self::Value>, String> {
        let a = column::<BooleanArray>(batch, name)?;
        no_nulls(a)?;
        Ok(a.iter().map(Option::unwrap_or_default).collect())
    }
}

impl Kind for Pids {
    type Value = Option<Vec<u32>>;
    const NULLABLE: bool = true;
    fn array<'a>(values: impl Iterator<Item = &'a Self::Value>) -> ArrayRef {
        let mut b = ListBuilder::new(UInt32Builder::new());
        for v in values {
            match v {
                Some(pids) => {
                    b.values().append_slice(pids);
                    b.append(true);
                }
                None => b.append(false),
            }
        }
        Arc::new(b.finish())
    }
    fn get(batch: &RecordBatch, name: &str) -> Result<Vec<Self::Value>, String> {
        let a = column::<ListArray>(batch, name)?;
        (0..a.len())
            .map(|i| {
                if a.is_null(i) {
                    return Ok(None);
                }
                let v = a.value(i);
                let pids = v
                    .as_any()
                    .downcast_ref::<PrimitiveArray<UInt32Type>>()
                    .ok_or_else(|| format!("a list of {}, not of UInt32", v.data_type()))?;
                Ok(Some(pids.iter().flatten().collect()))
            })
            .collect()
    }
}
