//! `string_enum!`: a unit-only enum whose every variant has one spelling, shared by serde, the
//! schema (an `enum` of strings), `Display`, `FromStr` and `as_str`, so that the YAML a user
//! writes, the value the operator renders and the text in a message can never differ.

use std::fmt;

/// A value that is not one of an enum's spellings.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{value:?} is not one of {}", .expected.join(", "))]
pub struct UnknownValue {
    pub value: String,
    /// The accepted spellings.
    pub expected: &'static [&'static str],
}

/// Writes `s` (used by the generated `Display`s).
pub(crate) fn write_str(f: &mut fmt::Formatter<'_>, s: &str) -> fmt::Result {
    f.pad(s)
}

macro_rules! string_enum {
    (
        $(#[$meta:meta])*
        pub enum $name:ident { $($variant:ident = $text:literal),+ $(,)? }
        default = $default:ident
    ) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
        pub enum $name {
            $(
                #[serde(rename = $text)]
                $variant,
            )+
        }

        impl $name {
            /// Every value, in the schema's order.
            pub const ALL: &'static [$name] = &[$($name::$variant),+];

            /// The spelling in the resource (and in Valkey's or Kubernetes' own settings).
            pub fn as_str(self) -> &'static str {
                match self {
                    $($name::$variant => $text,)+
                }
            }
        }

        impl Default for $name {
            fn default() -> Self {
                $name::$default
            }
        }

        impl ::std::fmt::Display for $name {
            fn fmt(&self, f: &mut ::std::fmt::Formatter<'_>) -> ::std::fmt::Result {
                $crate::string_enum::write_str(f, self.as_str())
            }
        }

        impl ::std::str::FromStr for $name {
            type Err = $crate::string_enum::UnknownValue;

            fn from_str(s: &str) -> Result<Self, Self::Err> {
                $name::ALL
                    .iter()
                    .copied()
                    .find(|v| v.as_str() == s)
                    .ok_or_else(|| $crate::string_enum::UnknownValue {
                        value: s.to_string(),
                        expected: &[$($text),+],
                    })
            }
        }
    };
}
