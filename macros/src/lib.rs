//! memra-macros: thin proc-macro entry points; the logic lives in modules beside this file.
