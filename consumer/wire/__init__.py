"""Wire formats of request values besides kinference's own JSON (``kinference.protocol``), and the bounds every
value is read within: ``oip`` (the Open Inference Protocol V2), ``serdes`` (Schema Registry: Avro, Protobuf, JSON
Schema), ``jsonscan`` (what a JSON value costs, read at C speed), ``schemabounds`` (the same bounds for Schema Registry
values) and ``schemaids`` (a Schema Registry value's schema id, read and bounded first, and looked up once per
interval)."""
