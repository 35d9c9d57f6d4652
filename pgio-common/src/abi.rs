//! The one convention for integers the kernel side writes and userspace reads back as enums:
//! `abi_enum!` gives each enum its discriminants, `ALL`, `name()` and `TryFrom<repr>`, and
//! every value no variant has is the same error, [`UnknownValue`], which readers skip.

/// A value the kernel wrote that no variant of the enum has: an object built from other
/// sources than this daemon. Readers leave such keys out rather than guess.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UnknownValue(pub u32);

/// `abi_enum! { pub enum E: u8 { A = 0 => "a", … } }`: a `#[repr(u8)]` enum with
/// `E::ALL` (in declaration order), `E::name(self)` and `TryFrom<u8, Error = UnknownValue>`.
#[macro_export]
macro_rules! abi_enum {
    (
        $(#[$meta:meta])*
        $vis:vis enum $name:ident : $repr:ident {
            $( $(#[$vmeta:meta])* $variant:ident = $value:literal => $label:literal, )+
        }
    ) => {
        $(#[$meta])*
        #[repr($repr)]
        #[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
        $vis enum $name {
            $( $(#[$vmeta])* $variant = $value, )+
        }

        impl $name {
            /// Every variant, in declaration order.
            pub const ALL: [$name; [$($label),+].len()] = [$($name::$variant),+];

            /// Its label value (and, for syscalls, its tracepoint name).
            pub const fn name(self) -> &'static str {
                match self {
                    $( $name::$variant => $label, )+
                }
            }
        }

        impl TryFrom<$repr> for $name {
            type Error = $crate::abi::UnknownValue;

            #[inline(always)]
            fn try_from(v: $repr) -> Result<$name, $crate::abi::UnknownValue> {
                match v {
                    $( $value => Ok($name::$variant), )+
                    _ => Err($crate::abi::UnknownValue(v as u32)),
                }
            }
        }
    };
}

/// `size_of` and `align_of` of a type shared with the kernel, checked at compile time: a
/// field added on one side only fails the build of both.
#[macro_export]
macro_rules! abi_size {
    ($t:ty, $size:expr, $align:expr) => {
        const _: () = assert!(core::mem::size_of::<$t>() == $size);
        const _: () = assert!(core::mem::align_of::<$t>() == $align);
    };
}

/// `aya::Pod` for types shared with the kernel, in userspace builds (`user` feature).
#[macro_export]
macro_rules! abi_pod {
    ($($t:ty),+ $(,)?) => {
        $(
            #[cfg(feature = "user")]
            // SAFETY: #[repr(C)] (or transparent) plain integers with explicit padding fields.
            unsafe impl aya::Pod for $t {}
        )+
    };
}

#[cfg(test)]
mod tests {
    abi_enum! {
        enum Colour: u8 {
            Red = 0 => "red",
            /// Documented variants work too.
            Green = 1 => "green",
            Blue = 7 => "blue",
        }
    }

    #[test]
    fn all_names_and_the_one_rule_for_unknown_values() {
        assert_eq!(Colour::ALL, [Colour::Red, Colour::Green, Colour::Blue]);
        assert_eq!(Colour::Blue.name(), "blue");
        for c in Colour::ALL {
            assert_eq!(Colour::try_from(c as u8), Ok(c));
        }
        assert_eq!(Colour::try_from(2), Err(super::UnknownValue(2)));
        assert_eq!(Colour::try_from(255), Err(super::UnknownValue(255)));
    }
}
