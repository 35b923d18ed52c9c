"""Sandbox networking and syscall policy: seccomp profiles, network namespaces, egress."""
