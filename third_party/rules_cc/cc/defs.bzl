# Re-exports the native C++ rules under the names @rules_cc//cc:defs.bzl provides.
cc_binary = native.cc_binary
cc_import = native.cc_import
cc_library = native.cc_library
cc_proto_library = native.cc_proto_library
cc_shared_library = getattr(native, "cc_shared_library", None)
cc_test = native.cc_test
cc_toolchain = native.cc_toolchain
cc_toolchain_suite = native.cc_toolchain_suite
objc_library = native.objc_library
objc_import = native.objc_import
fdo_prefetch_hints = native.fdo_prefetch_hints
fdo_profile = native.fdo_profile
