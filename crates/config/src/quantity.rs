//! Kubernetes `resource.Quantity`, parsed exactly.
//!
//! Grammar (as in `k8s.io/apimachinery/pkg/api/resource`):
//! `<sign><digits>[.<digits>]<suffix>` where the suffix is a binary SI suffix
//! (`Ki Mi Gi Ti Pi Ei`), a decimal SI suffix (`n u m "" k M G T P E`) or a decimal exponent
//! (`e3`, `E-2`). Values are kept in nano-units, rounded up like Kubernetes does, so
//! `1.5Gi`, `100m` and `1e3` are all exact.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A parsed quantity: its exact value in nano-units and the text it was written as.
///
/// ```
/// use vmhost_config::Quantity;
/// let q: Quantity = "1.5Gi".parse().unwrap();
/// assert_eq!(q.to_bytes().unwrap(), 1_610_612_736);
/// let cpu: Quantity = "100m".parse().unwrap();
/// assert_eq!(cpu.to_millis(), 100);
/// ```
#[derive(Debug, Clone)]
pub struct Quantity {
    nanos: i128,
    text: String,
}

/// Why a quantity string is not a valid Kubernetes quantity.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{text:?} is not a Kubernetes quantity ({why}); write e.g. \"512Mi\", \"16Gi\", \"1G\", \"1.5Gi\", \"4\" or \"100m\"")]
pub struct QuantityError {
    /// The text that failed to parse.
    pub text: String,
    /// What is wrong with it.
    pub why: &'static str,
}

const NANO: i128 = 1_000_000_000;

impl Quantity {
    /// The exact value in nano-units (1 = 1e-9).
    pub fn nanos(&self) -> i128 {
        self.nanos
    }

    /// The text the user wrote.
    pub fn text(&self) -> &str {
        &self.text
    }

    /// True when the value is below zero.
    pub fn is_negative(&self) -> bool {
        self.nanos < 0
    }

    /// The value rounded up (away from zero) to a whole number, like `Quantity.Value()`.
    pub fn ceil(&self) -> i128 {
        ceil_div(self.nanos, NANO)
    }

    /// The value in milli-units rounded up, like `Quantity.MilliValue()`.
    pub fn to_millis(&self) -> i128 {
        ceil_div(self.nanos, 1_000_000)
    }

    /// The value as a byte count (rounded up to a whole byte); `None` when negative or too large.
    pub fn to_bytes(&self) -> Option<u64> {
        if self.nanos < 0 {
            return None;
        }
        u64::try_from(self.ceil()).ok()
    }

    /// A quantity of exactly `bytes`, written in the largest binary unit that divides it.
    pub fn from_bytes(bytes: u64) -> Self {
        Quantity {
            nanos: i128::from(bytes) * NANO,
            text: format_bytes(bytes),
        }
    }
}

/// Formats a byte count with the largest binary suffix that divides it exactly (`2Mi`, `1536Mi`).
pub fn format_bytes(bytes: u64) -> String {
    const UNITS: [(&str, u64); 5] = [
        ("Pi", 1 << 50),
        ("Ti", 1 << 40),
        ("Gi", 1 << 30),
        ("Mi", 1 << 20),
        ("Ki", 1 << 10),
    ];
    if bytes == 0 {
        return "0".to_string();
    }
    for (suffix, unit) in UNITS {
        if bytes % unit == 0 {
            return format!("{}{suffix}", bytes / unit);
        }
    }
    bytes.to_string()
}

/// `n / d` rounded away from zero, as Kubernetes rounds `Value()` and `MilliValue()`.
fn ceil_div(n: i128, d: i128) -> i128 {
    let q = n / d;
    match (n % d).signum() {
        1 => q + 1,
        -1 => q - 1,
        _ => q,
    }
}

impl PartialEq for Quantity {
    fn eq(&self, other: &Self) -> bool {
        self.nanos == other.nanos
    }
}

impl fmt::Display for Quantity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

impl FromStr for Quantity {
    type Err = QuantityError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = |why| QuantityError {
            text: s.to_string(),
            why,
        };
        let t = s.trim();
        if t.is_empty() {
            return Err(err("it is empty"));
        }
        let (negative, rest) = match t.as_bytes()[0] {
            b'-' => (true, &t[1..]),
            b'+' => (false, &t[1..]),
            _ => (false, t),
        };
        let num_end = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        let (number, suffix) = rest.split_at(num_end);
        let (int_part, frac_part) = match number.split_once('.') {
            Some((i, f)) => (i, f),
            None => (number, ""),
        };
        if int_part.is_empty() && frac_part.is_empty() {
            return Err(err("it has no digits"));
        }
        if frac_part.contains('.') {
            return Err(err("it has two decimal points"));
        }
        let digits = format!("{int_part}{frac_part}");
        let digits = digits.trim_start_matches('0');
        if digits.len() > 36 {
            return Err(err("it has too many digits"));
        }
        let mantissa: i128 = if digits.is_empty() {
            0
        } else {
            digits.parse().map_err(|_| err("its digits do not parse"))?
        };
        let scale = i32::try_from(frac_part.len()).map_err(|_| err("it has too many digits"))?;
        let (pow2, pow10) = parse_suffix(suffix).ok_or_else(|| err("unknown suffix"))?;
        // value = mantissa * 2^pow2 * 10^(pow10 - scale); in nanos: * 10^9.
        let exp10 = pow10 - scale + 9;
        let too_big = || err("it is too large");
        let mut num = mantissa.checked_mul(1i128 << pow2).ok_or_else(too_big)?;
        let mut den: i128 = 1;
        if exp10 >= 0 {
            let p = 10i128
                .checked_pow(exp10.unsigned_abs())
                .ok_or_else(too_big)?;
            num = num.checked_mul(p).ok_or_else(too_big)?;
        } else {
            den = 10i128
                .checked_pow(exp10.unsigned_abs())
                .ok_or_else(|| err("it is too precise"))?;
        }
        let nanos = ceil_div(num, den);
        if nanos > i128::from(u64::MAX) * NANO {
            return Err(too_big());
        }
        Ok(Quantity {
            nanos: if negative { -nanos } else { nanos },
            text: t.to_string(),
        })
    }
}

/// Returns (power of two, power of ten) for a suffix.
fn parse_suffix(s: &str) -> Option<(u32, i32)> {
    let binary = |n: u32| Some((10 * n, 0));
    match s {
        "" => Some((0, 0)),
        "Ki" => binary(1),
        "Mi" => binary(2),
        "Gi" => binary(3),
        "Ti" => binary(4),
        "Pi" => binary(5),
        "Ei" => binary(6),
        "n" => Some((0, -9)),
        "u" => Some((0, -6)),
        "m" => Some((0, -3)),
        "k" => Some((0, 3)),
        "M" => Some((0, 6)),
        "G" => Some((0, 9)),
        "T" => Some((0, 12)),
        "P" => Some((0, 15)),
        "E" => Some((0, 18)),
        _ => {
            let exp = s.strip_prefix('e').or_else(|| s.strip_prefix('E'))?;
            let exp: i32 = exp.parse().ok()?;
            (-40..=40).contains(&exp).then_some((0, exp))
        }
    }
}

impl Serialize for Quantity {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&self.text)
    }
}

impl<'de> Deserialize<'de> for Quantity {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl serde::de::Visitor<'_> for Visitor {
            type Value = Quantity;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a Kubernetes quantity such as \"16Gi\", \"512Mi\", 4 or \"100m\"")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Quantity, E> {
                v.parse().map_err(E::custom)
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<Quantity, E> {
                self.visit_str(&v.to_string())
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<Quantity, E> {
                self.visit_str(&v.to_string())
            }
            fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<Quantity, E> {
                self.visit_str(&v.to_string())
            }
        }
        deserializer.deserialize_any(Visitor)
    }
}

#[cfg(test)]
mod tests {
    /// Found by fuzzing (fuzz/fuzz_targets/quantity.rs): `-1n` converted to 0 bytes, and
    /// negative values rounded toward zero where Kubernetes rounds away from it.
    #[test]
    fn negative_fraction_is_no_byte_count_and_rounds_away_from_zero() {
        let q: Quantity = "-1n".parse().unwrap();
        assert!(q.is_negative());
        assert_eq!(q.to_bytes(), None);
        assert_eq!(q.ceil(), -1);
        assert_eq!("-1.5".parse::<Quantity>().unwrap().ceil(), -2);
        assert_eq!("-100m".parse::<Quantity>().unwrap().to_millis(), -100);
        assert_eq!("-1u".parse::<Quantity>().unwrap().to_millis(), -1);
        assert_eq!("1.5".parse::<Quantity>().unwrap().ceil(), 2);
        assert_eq!("0".parse::<Quantity>().unwrap().to_bytes(), Some(0));
    }

    use super::*;
    use proptest::prelude::*;

    fn q(s: &str) -> Quantity {
        s.parse().unwrap()
    }

    #[test]
    fn binary_and_decimal_suffixes() {
        assert_eq!(q("16Gi").to_bytes(), Some(16 << 30));
        assert_eq!(q("512Mi").to_bytes(), Some(512 << 20));
        assert_eq!(q("1G").to_bytes(), Some(1_000_000_000));
        assert_eq!(q("1.5Gi").to_bytes(), Some(1_610_612_736));
        assert_eq!(q("2Ki").to_bytes(), Some(2048));
        assert_eq!(q("1k").to_bytes(), Some(1000));
        assert_eq!(q("1e3").to_bytes(), Some(1000));
        assert_eq!(q("1E-3").to_millis(), 1);
        assert_eq!(q(".5Gi").to_bytes(), Some(512 << 20));
    }

    #[test]
    fn cpu_quantities() {
        assert_eq!(q("100m").to_millis(), 100);
        assert_eq!(q("100m").ceil(), 1);
        assert_eq!(q("2").to_millis(), 2000);
        assert_eq!(q("1.5").ceil(), 2);
        assert_eq!(q("0.25").to_millis(), 250);
    }

    #[test]
    fn fractional_bytes_round_up() {
        assert_eq!(q("0.5").to_bytes(), Some(1));
        assert_eq!(q("1.0000001Ki").to_bytes(), Some(1025));
    }

    #[test]
    fn negative_values_parse_but_are_flagged() {
        let v = q("-1Gi");
        assert!(v.is_negative());
        assert_eq!(v.to_bytes(), None);
    }

    #[test]
    fn rejects_garbage() {
        for bad in [
            "",
            "Gi",
            "1GB",
            "1.2.3",
            "abc",
            "1 Gi",
            "1e99",
            "99999999999999999999Ei",
        ] {
            let e = bad.parse::<Quantity>().unwrap_err();
            assert_eq!(e.text, bad);
            assert!(e.to_string().contains("Kubernetes quantity"), "{e}");
        }
    }

    #[test]
    fn format_bytes_picks_largest_unit() {
        assert_eq!(format_bytes(2 << 20), "2Mi");
        assert_eq!(format_bytes(1536 << 20), "1536Mi");
        assert_eq!(format_bytes(1 << 30), "1Gi");
        assert_eq!(format_bytes(1000), "1000");
        assert_eq!(format_bytes(0), "0");
    }

    proptest! {
        #[test]
        fn binary_suffix_roundtrip(v in 0u64..1_000_000, unit in 0usize..4) {
            let suffix = ["Ki", "Mi", "Gi", "Ti"][unit];
            let bytes = v << (10 * (u32::try_from(unit).unwrap() + 1));
            prop_assert_eq!(q(&format!("{v}{suffix}")).to_bytes(), Some(bytes));
            prop_assert_eq!(q(&format_bytes(bytes)).to_bytes(), Some(bytes));
        }
    }
}
