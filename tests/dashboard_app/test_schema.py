"""The reader's schema against the connector's span kinds: the reader keeps its own copy of the contract
(it reads files of older kvscope versions too), and a key added on the connector's side alone would land,
unnoticed, in the catch-all `attributes` dict instead of a column the pages read."""

from __future__ import annotations

from connector.groups import GroupKind
from connector.metadata import LOAD, STORE
from connector.telemetry.span_records import GENERIC_SPAN, KINDS
from dashboard.traces import schema

KEPT_IN_ATTRIBUTES = {schema.DEFERRAL_OUTCOME}  # read by the deferral shaping from the `attributes` dict


def test_every_attribute_the_connector_writes_has_a_column_of_its_type():
    for kind in KINDS:
        if kind is GENERIC_SPAN:
            continue
        assert kind.name in schema.SPAN_NAMES
        for key, value_type in kind.attributes:
            if key in KEPT_IN_ATTRIBUTES:
                assert key not in schema.ATTRIBUTE_COLUMNS
                continue
            assert key in schema.ATTRIBUTE_COLUMNS, f"{kind.name}'s {key} has no column in dashboard/traces/schema.py"
            column, is_integer = schema.ATTRIBUTE_COLUMNS[key]
            assert is_integer is (value_type is int), f"{key}: column {column} reads it as the other type"


def test_every_required_attribute_is_one_the_connector_writes_and_the_allowed_values_are_its_own():
    written = {kind.name: set(kind.keys) for kind in KINDS if kind is not GENERIC_SPAN}
    for name, required in schema.REQUIRED_ATTRIBUTES.items():
        assert set(required) <= written[name], name
    assert set(schema.GROUP_KINDS) == {kind.value for kind in GroupKind}
    assert set(schema.DIRECTIONS) == {LOAD, STORE}
