"""Three real-world JSON schemas, each with one valid instance, for structured-output benchmarks.

- tool_call: an OpenAI function-calling tool's parameters (the weather example
  from OpenAI's docs, with an enum and a nested array of objects).
- invoice: a document-extraction schema of the kind people send with
  response_format (nested objects, arrays, formats, numbers with bounds).
- package: a subset of the npm package.json schema from SchemaStore
  ($defs with $ref, anyOf, patternProperties-free maps via additionalProperties).
"""

from __future__ import annotations

TOOL_CALL = {
    "type": "object",
    "properties": {
        "location": {"type": "string", "description": "City and country, e.g. Paris, France"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "fields": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": ["temperature", "wind", "rain", "humidity"]},
                    "hourly": {"type": "boolean"},
                },
                "required": ["name", "hourly"],
                "additionalProperties": False,
            },
        },
    },
    "required": ["location", "unit", "days", "fields"],
    "additionalProperties": False,
}
TOOL_CALL_INSTANCE = {
    "location": "Paris, France",
    "unit": "celsius",
    "days": 3,
    "fields": [{"name": "temperature", "hourly": True}, {"name": "rain", "hourly": False}],
}

INVOICE = {
    "type": "object",
    "properties": {
        "invoice_number": {"type": "string", "pattern": "^INV-[0-9]{4,8}$"},
        "issued": {"type": "string", "format": "date"},
        "vendor": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 80},
                "email": {"type": "string", "format": "email"},
                "address": {
                    "type": "object",
                    "properties": {
                        "street": {"type": "string"},
                        "city": {"type": "string"},
                        "postcode": {"type": "string"},
                        "country": {"type": "string", "minLength": 2, "maxLength": 2},
                    },
                    "required": ["street", "city", "country"],
                    "additionalProperties": False,
                },
            },
            "required": ["name", "address"],
            "additionalProperties": False,
        },
        "lines": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "properties": {
                    "description": {"type": "string"},
                    "quantity": {"type": "integer", "minimum": 1},
                    "unit_price": {"type": "number", "minimum": 0},
                    "tax_rate": {"type": "number", "minimum": 0, "maximum": 1},
                },
                "required": ["description", "quantity", "unit_price"],
                "additionalProperties": False,
            },
        },
        "currency": {"type": "string", "enum": ["EUR", "USD", "GBP", "CHF"]},
        "total": {"type": "number"},
        "paid": {"type": "boolean"},
    },
    "required": ["invoice_number", "issued", "vendor", "lines", "currency", "total"],
    "additionalProperties": False,
}
INVOICE_INSTANCE = {
    "invoice_number": "INV-20231",
    "issued": "2024-03-18",
    "vendor": {
        "name": "ACME GmbH",
        "email": "billing@acme.example",
        "address": {"street": "Hauptstr. 1", "city": "Berlin", "postcode": "10115", "country": "DE"},
    },
    "lines": [
        {"description": "Widgets", "quantity": 12, "unit_price": 3.5, "tax_rate": 0.19},
        {"description": "Shipping", "quantity": 1, "unit_price": 9.9},
    ],
    "currency": "EUR",
    "total": 61.88,
    "paid": False,
}

PACKAGE = {
    "$defs": {
        "person": {
            "anyOf": [
                {"type": "string"},
                {
                    "type": "object",
                    "properties": {"name": {"type": "string"}, "email": {"type": "string"}, "url": {"type": "string"}},
                    "required": ["name"],
                    "additionalProperties": False,
                },
            ]
        },
        "deps": {"type": "object", "additionalProperties": {"type": "string"}},
    },
    "type": "object",
    "properties": {
        "name": {
            "type": "string",
            "pattern": "^(?:@[a-z0-9-~][a-z0-9-._~]*/)?[a-z0-9-~][a-z0-9-._~]*$",
            "maxLength": 214,
        },
        "version": {"type": "string"},
        "description": {"type": "string"},
        "keywords": {"type": "array", "items": {"type": "string"}},
        "license": {"type": "string"},
        "author": {"$ref": "#/$defs/person"},
        "contributors": {"type": "array", "items": {"$ref": "#/$defs/person"}},
        "main": {"type": "string"},
        "scripts": {"type": "object", "additionalProperties": {"type": "string"}},
        "dependencies": {"$ref": "#/$defs/deps"},
        "devDependencies": {"$ref": "#/$defs/deps"},
        "private": {"type": "boolean"},
        "engines": {
            "type": "object",
            "properties": {"node": {"type": "string"}, "npm": {"type": "string"}},
            "additionalProperties": False,
        },
    },
    "required": ["name", "version"],
    "additionalProperties": False,
}
PACKAGE_INSTANCE = {
    "name": "@acme/widgets",
    "version": "1.4.2",
    "description": "Widgets for the web",
    "keywords": ["widgets", "ui"],
    "license": "MIT",
    "author": {"name": "Ada", "email": "ada@acme.example"},
    "main": "index.js",
    "scripts": {"test": "node --test", "build": "tsc -p ."},
    "dependencies": {"left-pad": "^1.3.0"},
    "private": False,
    "engines": {"node": ">=18"},
}

SCHEMAS = {
    "tool_call": (TOOL_CALL, TOOL_CALL_INSTANCE),
    "invoice": (INVOICE, INVOICE_INSTANCE),
    "package": (PACKAGE, PACKAGE_INSTANCE),
}
